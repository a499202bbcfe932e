"""paroattn's ComfyUI nodes: PARO plans (per-head token orders and static block-sparse masks) in ComfyUI graphs.

Load PARO plan -> Apply PARO -> any sampler; PARO calibrate writes plans. Install by putting this folder in
ComfyUI/custom_nodes with paroattn installed in ComfyUI's Python (`pip install paroattn`).
"""

from .paro_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
