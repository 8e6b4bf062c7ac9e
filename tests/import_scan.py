"""What the import tests share: which nodes of a module's syntax tree run for annotations only."""

import ast


def typing_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only)."""
    def checks_types(test: ast.expr) -> bool:
        return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")

    return {id(node) for branch in ast.walk(tree)
            if isinstance(branch, ast.If) and checks_types(branch.test)
            for statement in branch.body for node in ast.walk(statement)}
