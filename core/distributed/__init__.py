"""Tensor and pipeline parallelism: process groups, the device communicator, pipeline records.

Importing this package is cheap (torch is imported when a group is used). The API lives in
:mod:`llmhal.distributed.parallel_state`; its names are re-exported here.
"""

from llmhal.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed,
    distributed_initialized,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_distributed,
)

__all__ = [
    "GroupCoordinator",
    "destroy_distributed",
    "distributed_initialized",
    "get_pp_group",
    "get_tp_group",
    "get_world_group",
    "init_distributed",
]
