"""Tiny diffusers / transformers / peft objects built from configs, for the ecosystem tests (helper, not a test module).

Nothing here touches the hub: every model is built from a config with a fixed seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

IDS = torch.tensor([[3, 9, 4, 20, 7, 11]])
PROMPT_IDS = torch.tensor([[1, 5, 7, 9, 2]])


def hook_owner(model: torch.nn.Module) -> set[str]:
    """The top-level packages of every hook attached to ``model`` (``{"bigmodel"}`` when bigmodel dispatched it)."""
    owners = set()
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        if hook is not None:
            owners.add(type(hook).__module__.split(".")[0])
            owners.update(type(h).__module__.split(".")[0] for h in getattr(hook, "hooks", ()))
    return owners


def tiny_unet() -> Any:
    """A 2-block UNet2DConditionModel (float32, ~1.5 MB) with cross-attention over 32-wide embeddings."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    ).eval()  # fmt: skip


def tiny_vae() -> Any:
    """A 2-block AutoencoderKL (float32) with 4 latent channels."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(32, 32),
        latent_channels=4, norm_num_groups=32, sample_size=16,
    ).eval()  # fmt: skip


def tiny_text_encoder() -> Any:
    """A 2-layer CLIPTextModel with a 100-token vocabulary."""
    import transformers

    torch.manual_seed(0)
    config = transformers.CLIPTextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        projection_dim=32, max_position_embeddings=16, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    )  # fmt: skip
    return transformers.CLIPTextModel(config).eval()


def unet_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sample [1, 4, 8, 8], timestep, encoder_hidden_states [1, 5, 32]) for :func:`tiny_unet`."""
    sample = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    states = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1))
    return sample, torch.tensor(3), states


def latents() -> torch.Tensor:
    return torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))


def tiny_pipeline() -> Any:
    """A text-encoder → UNet → VAE pipeline run through diffusers' own offload machinery."""
    from diffusers import DDIMScheduler, DiffusionPipeline

    class TinyPipeline(DiffusionPipeline):
        model_cpu_offload_seq = "text_encoder->unet->vae"

        def __init__(self, text_encoder: Any, unet: Any, vae: Any, scheduler: Any) -> None:
            super().__init__()
            self.register_modules(text_encoder=text_encoder, unet=unet, vae=vae, scheduler=scheduler)

        @torch.no_grad()
        def __call__(self, input_ids: torch.Tensor, start: torch.Tensor, steps: int = 2) -> torch.Tensor:
            states = self.text_encoder(input_ids.to(self._execution_device))[0]
            self.scheduler.set_timesteps(steps)
            sample = start
            for t in self.scheduler.timesteps:
                noise = self.unet(sample, t, encoder_hidden_states=states).sample
                sample = self.scheduler.step(noise, t, sample).prev_sample
            image = self.vae.decode(sample / self.vae.config.scaling_factor).sample
            self.maybe_free_model_hooks()
            return image

    return TinyPipeline(tiny_text_encoder(), tiny_unet(), tiny_vae(), DDIMScheduler(num_train_timesteps=10))


def write_lora_adapter(base_folder: Path, target: Path) -> Path:
    """Save a rank-4 LoRA adapter (q_proj, v_proj; non-zero B so it changes the outputs) for the tiny llama."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    torch.manual_seed(1)
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(str(target))
    return target
