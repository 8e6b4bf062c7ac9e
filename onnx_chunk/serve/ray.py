"""Ray Serve: the server as N replicas, each its own process with its own runtime.

Each replica loads the model once (its weights, its batch engine, its variant cache: nothing is
shared between replicas, so every replica warms its own ladder) and serves the same app as
`onnx-chunk serve`; Ray's HTTP proxy spreads requests over the replicas. Give each replica one
GPU (`gpus_per_replica=1`: Ray sets CUDA_VISIBLE_DEVICES, so every replica sees its GPU as
device 0) or, on CPU, the cores of one socket (`cpus_per_replica`, with `intra_op_threads`
to match). Needs the `ray` extra (`pip install 'onnx-chunk[ray]'`).

    from ray import serve
    from onnx_chunk.serve.ray import application
    serve.run(application("path/to/model", replicas=2, gpus_per_replica=1))
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from onnx_chunk.errors import ConfigError
from onnx_chunk.serve.app import DEFAULT_MAX_BODY_BYTES


def application(model: str | os.PathLike, *, replicas: int = 1, gpus_per_replica: float = 0,
                cpus_per_replica: float = 1, provider: str = "auto", batch: int = 4,
                queue: int = 64, capacity: int | None = None,
                intra_op_threads: int | None = None, api_key: str | None = None,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                parse_special_in_content: bool = False, name: str = "onnx-chunk") -> Any:
    """A Ray Serve application of `replicas` replicas of the server on `model` (bind()ed;
    pass it to `serve.run`). Every option but the Ray resources is `load`'s or the server's."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
    model_path = os.fspath(model)
    load_options = {"provider": provider, "max_batch": batch, "max_queue": queue,
                    "capacity": capacity, "intra_op_threads": intra_op_threads}

    def replica_app() -> Any:
        """Run on each replica as it starts: its own runtime and app."""
        from onnx_chunk.runtime import load
        from onnx_chunk.serve import create_app

        return create_app(load(model_path, **load_options), api_key=api_key,
                          max_body_bytes=max_body_bytes,
                          parse_special_in_content=parse_special_in_content)

    @serve.deployment(name=name, num_replicas=replicas,
                      ray_actor_options={"num_gpus": gpus_per_replica,
                                         "num_cpus": cpus_per_replica})
    @serve.ingress(replica_app)
    class Replica:
        """One replica of the server (the app does the work)."""

    return Replica.bind()
