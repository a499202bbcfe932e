"""Running a plan, for every integration: `PlanRunner` (the plan of each call's size, whether a kernel runs the
calls, the masks on the call's device, the op call of one layer) and `MaskStore` (a plan's masks on one device,
resident or streamed on a side CUDA stream). The diffusers processor (`paroattn.pipelines`) and the ComfyUI
pack's hook are adapters over it: they find each call's layer, layout and timestep in their framework's way."""

from .runner import PlanRunner, reset
from .store import RESIDENT_LIMIT_BYTES, MaskStore, list_bytes

__all__ = ["RESIDENT_LIMIT_BYTES", "MaskStore", "PlanRunner", "list_bytes", "reset"]
