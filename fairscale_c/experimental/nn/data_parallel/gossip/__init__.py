"""fairscale_c.experimental.nn.data_parallel.gossip — SlowMo and its gossip pieces, as in
fairscale.experimental.nn.data_parallel.gossip: the wrapper, the push-sum / push-pull gossipers,
the peer graphs and the mixing weights."""

from .distributed import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from .gossiper import PushPull, PushSum
from .graph_manager import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)
from .mixing_manager import MixingManager, UniformMixing
from .utils import communicate
from .utils.cuda_metering import CudaEventRecorder

__all__ = [
    "SlowMoBaseAlgorithm",
    "SlowMoDistributedDataParallel",
    "PushPull",
    "PushSum",
    "GraphManager",
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
    "MixingManager",
    "UniformMixing",
    "communicate",
    "CudaEventRecorder",
]
