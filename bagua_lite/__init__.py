"""bagua_lite: communication relaxations for data-parallel PyTorch training on slow networks."""
import torch  # noqa: F401  (loads libtorch before the extension)

from ._compat import check_supported

check_supported()  # a clear error on a torch older than 2.11, before the extension fails to load

from . import comm, compressors, hooks, kernels, runtime  # noqa: F401,E402
from .algorithm import Algorithm, register  # noqa: F401
from .checkpoint import load_checkpoint, save_checkpoint  # noqa: F401
from .compressors import Compressor, register_compressor  # noqa: F401
from .config import Config, load_config, parse_config, shipped_configs  # noqa: F401
from .distributed import DistributedModel  # noqa: F401
from ._failfast import PeerFailedError  # noqa: F401
from .elastic import MembershipChanged, MembershipError  # noqa: F401
from .launch import init_process_group  # noqa: F401
from .ranks import get_local_rank, get_local_size, get_node_rank, get_rank, get_world_size  # noqa: F401
from .runtime import tune_cpu_allocator  # noqa: F401
from .sharded import ShardedModel  # noqa: F401

__version__ = "0.1.0"

from . import algorithms  # noqa: F401,E402  (last: the built-in relaxations register themselves by name)
