"""HunyuanVideo 1.5: `HunyuanVideo15AttnProcessor2_0` of its 54 dual-stream blocks split around its attention (the
token refiner's attention inside `context_embedder` is text-only and keeps its processor).

Sequence of a block: [F x H x W video ; T text], the text after the video (`TokenLayout.suffix`): the transformer
joins its three conditioning streams per sample as [valid image ; valid ByT5 ; valid MLLM ; the padding of each],
T = 729 + 256 + 1000 = 1985 at the pipeline's lengths, most of it padding (in text-to-video every image token is).
The video and the text have their own projections and q/k RMSNorm(head_dim); RoPE on the video tokens only
(interleaved pairs, diffusers' `apply_rotary_emb`), handed to the op as HunyuanVideo's: tables over the whole
sequence whose text rows are the identity. The model passes the text mask [B, T] (valid first, padding after) and
its processor makes a [B, 1, N, N] mask of valid query AND valid key; PARO passes the mask as the op's
`suffix_mask` (padded keys never attended). Padded text queries then attend to the valid keys instead of nothing:
their outputs differ from the model's, and nothing reads them (every later layer masks them as keys, and only the
video tokens leave the transformer), so the model's output is the same.

The VAE compresses space by 16 and time by 4 (patch size 1). Several GPUs: HunyuanVideo's context-parallel plan (the
video split at the first block, the text and its mask whole on every GPU; diffusers 0.42.1 has none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import TokenLayout
from .base import CallInputs, PixelScale, dispatch_dense
from .hunyuan_video import HunyuanVideoAdapter

# the pipeline's MLLM text, ByT5 glyph text and vision tokens, which the transformer joins after the video
DEFAULT_TEXT_TOKENS = 1000 + 256 + 729


class HunyuanVideo15Adapter(HunyuanVideoAdapter):
    name = "hunyuan_video15"
    models = "HunyuanVideo 1.5"
    transformer_classes = ("HunyuanVideo15Transformer3DModel",)
    attention_classes = ("Attention",)
    self_attention_paths = (("transformer_blocks", "attn"),)
    default_text_tokens = DEFAULT_TEXT_TOKENS
    default_frames = 121

    def default_scale(self, transformer) -> PixelScale:
        return PixelScale(temporal=4, spatial=16)

    # -- per forward -------------------------------------------------------------------------
    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        _, _, frames, height, width = arguments["hidden_states"].shape  # [B, C, F, H, W]
        text = sum(int(arguments[name].shape[1]) for name in ("encoder_hidden_states", "encoder_hidden_states_2",
                                                               "image_embeds") if arguments.get(name) is not None)
        return CallInputs(arguments["timestep"], self.grid_layout(transformer, frames, height, width, text))

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        # the forward joins the three streams into `encoder_hidden_states` (building `new_encoder_hidden_states`)
        # before its first block; the token refiner's attention runs before that, on the MLLM text alone
        if "new_encoder_hidden_states" in f_locals:
            text = f_locals["encoder_hidden_states"].shape[1]
        else:
            text = sum(int(f_locals[name].shape[1]) for name in ("encoder_hidden_states", "encoder_hidden_states_2",
                                                                  "image_embeds") if f_locals.get(name) is not None)
        layout = self.grid_layout(transformer, f_locals["num_frames"], f_locals["height"], f_locals["width"], text)
        return CallInputs(f_locals["timestep"], layout)

    # -- per self-attention call -------------------------------------------------------------
    def suffix_mask(self, attention_mask: torch.Tensor, layout: TokenLayout):
        """The model's text mask [B, T] (False at padding) as the op's `suffix_mask`, or None when nothing is
        padded (read on the host once per forward; kept as a tensor when traced)."""
        if attention_mask.dim() != 2 or attention_mask.shape[1] != layout.suffix:
            return False, None
        if torch.compiler.is_compiling():
            return True, attention_mask.bool()
        if self._padding is None or self._padding[0] is not attention_mask:
            self._padding = (attention_mask, None if bool(attention_mask.all()) else attention_mask.bool())
        return True, self._padding[1]

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        # the model's processor: the text mask padded with the (valid) video in front, valid query AND valid key
        if attention_mask is not None:
            batch, seq = call.q.shape[0], call.q.shape[2]
            keys = F.pad(attention_mask, (seq - attention_mask.shape[1], 0), value=True).bool()
            keys = keys.view(batch, 1, 1, seq).repeat(1, 1, seq, 1)
            attention_mask = keys & keys.transpose(2, 3)
        return dispatch_dense(call, attention_mask, backend, parallel_config)
