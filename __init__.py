"""ComfyUI's entry to this repository as a custom node pack: cloned into ComfyUI/custom_nodes, ComfyUI imports this
file and registers the nodes of comfyui/ (installing: comfyui/README.md). The paroattn package itself is
`paroattn/`; this file is not part of it."""

import sys

# ComfyUI has imported its folder_paths before it loads custom nodes. Anything else that imports this file (pytest
# collecting tests/ imports the repository root as a package) gets an empty module: the nodes need a running ComfyUI.
if "folder_paths" in sys.modules:
    from .comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
