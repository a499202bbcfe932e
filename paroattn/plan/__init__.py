"""Plans: what a PARO run needs, chosen offline or during a first generation.

- `model.py`: the `Plan` record, its safetensors file format, timestep buckets and model fingerprints;
- `masks.py`: a plan's block masks held packed (`BlockMasks`), unpacked one (bucket, layer) at a time;
- `storage.py`: reading a plan file within its size, and its checksum;
- `selection.py`: choosing orders and block masks from attention statistics, and rank balancing;
- `shapes.py`: deriving the masks of generation sizes a plan was not calibrated at;
- `balance.py`: rebalancing a plan's masks over the GPUs of a context-parallel run;
- `summary.py`: a plan described in words (`paro inspect`).
"""

from .masks import BlockMasks, pack_bits, unpack_bits
from .model import (
    FORMAT_VERSION,
    METADATA_KEY,
    Plan,
    bucket_edges_problem,
    bucket_index,
    bucket_tensor,
    default_bucket_edges,
    expert_plan_path,
    load_plans,
    model_config_record,
    model_fingerprint,
    write_safetensors,
)

__all__ = ["FORMAT_VERSION", "BlockMasks", "METADATA_KEY", "Plan", "bucket_edges_problem", "bucket_index", "bucket_tensor",
           "default_bucket_edges", "expert_plan_path", "load_plans", "model_config_record", "model_fingerprint",
           "pack_bits", "unpack_bits", "write_safetensors"]
