"""diffusers' offload paths (pipeline model/sequential CPU offload, device maps with disk, VAE
encode/decode through ``apply_forward_hook``) running on bigmodel through use_bigmodel().

Every output is compared bit for bit with the same component run without offload.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _tiny_ecosystem import (
    PROMPT_IDS,
    hook_owner,
    latents,
    tiny_pipeline,
    tiny_unet,
    tiny_vae,
    unet_inputs,
)
from diffusers import AutoencoderKL, UNet2DConditionModel

from bigmodel.integrations import use_bigmodel

pytestmark = pytest.mark.slow

UNET_SPLIT = {
    "conv_in": "cpu", "time_proj": "cpu", "time_embedding": "cpu", "down_blocks": "disk", "up_blocks": "disk",
    "mid_block": "cpu", "conv_norm_out": "cpu", "conv_act": "cpu", "conv_out": "disk",
}  # fmt: skip


@pytest.fixture
def on():
    with use_bigmodel() as patch:
        yield patch


@pytest.fixture(scope="module")
def reference_image() -> torch.Tensor:
    return tiny_pipeline()(PROMPT_IDS, latents())


@pytest.fixture(scope="module")
def unet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("eco-unet") / "unet"
    tiny_unet().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def unet_reference() -> torch.Tensor:
    with torch.no_grad():
        return tiny_unet()(*unet_inputs()).sample


def test_model_cpu_offload_is_bit_exact(on, reference_image: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    assert {type(pipe.unet._hf_hook).__module__.split(".")[0]} == {"bigmodel"}
    assert torch.equal(pipe(PROMPT_IDS, latents()), reference_image)
    assert torch.equal(pipe(PROMPT_IDS, latents()), reference_image)  # after maybe_free_model_hooks re-armed them
    pipe.remove_all_hooks()
    assert not any(hasattr(m, "_hf_hook") for m in pipe.unet.modules())


def test_sequential_cpu_offload_is_bit_exact(on, reference_image: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    pipe.enable_sequential_cpu_offload(device="cpu")
    assert hook_owner(pipe.unet) == {"bigmodel"}
    assert pipe.unet.conv_in.weight.device.type == "meta"  # weights come in per submodule forward
    assert torch.equal(pipe(PROMPT_IDS, latents()), reference_image)
    assert pipe.unet.conv_in.weight.device.type == "meta"
    assert torch.equal(pipe(PROMPT_IDS, latents()), reference_image)


def test_switching_between_offload_modes_is_bit_exact(on, reference_image: torch.Tensor) -> None:
    # huggingface/diffusers#2907 and PR #7448: each enable_* call removes the hooks the previous one
    # attached (pipe.remove_all_hooks) and attaches its own.  With accelerate 1.15 on the CPU, sequential
    # offload after model offload fails at the next call (TypeError from a Parameter rebuilt as a plain
    # Tensor) and a second enable_sequential_cpu_offload fails removing the hooks; bigmodel runs them all.
    pipe = tiny_pipeline()
    for enable in ("model", "model", "sequential", "sequential", "model"):
        getattr(pipe, f"enable_{enable}_cpu_offload")(device="cpu")
        assert torch.equal(pipe(PROMPT_IDS, latents()), reference_image), enable
    pipe.remove_all_hooks()
    assert not any(p.is_meta for p in pipe.unet.parameters())
    assert torch.equal(pipe(PROMPT_IDS, latents()), reference_image)


def test_unet_with_a_disk_device_map_is_bit_exact(on, unet_folder: Path, tmp_path: Path, unet_reference) -> None:
    offload = tmp_path / "offload"
    unet = UNet2DConditionModel.from_pretrained(str(unet_folder), device_map=UNET_SPLIT, offload_folder=str(offload))
    assert hook_owner(unet) == {"bigmodel"}
    index = json.loads((offload / "index.json").read_text())
    assert "conv_out.weight" in index and "conv_in.weight" not in index
    with torch.no_grad():
        assert torch.equal(unet(*unet_inputs()).sample, unet_reference)


@pytest.fixture(scope="module")
def unet_loaded_reference(unet_folder: Path) -> torch.Tensor:
    """The UNet loaded by diffusers without bigmodel (module scope: before the function-scoped ``on``).

    diffusers keeps the loaded weights as views of the mapped safetensors file, most of them not 64-byte
    aligned, and some CPU kernels then round differently (~1e-6) from the freshly built model's aligned
    weights; a model loaded the same way is the bit-exact reference.
    """
    with torch.no_grad():
        return UNet2DConditionModel.from_pretrained(str(unet_folder))(*unet_inputs()).sample


def test_unet_loaded_without_a_map_goes_through_bigmodels_meta_init(
    on, unet_folder: Path, unet_reference, unet_loaded_reference
) -> None:
    # low_cpu_mem_usage (the default): accelerate.init_empty_weights + set_module_tensor_to_device per tensor.
    unet = UNet2DConditionModel.from_pretrained(str(unet_folder))
    assert not hasattr(unet, "hf_device_map") and hook_owner(unet) == set()
    with torch.no_grad():
        out = unet(*unet_inputs()).sample
    assert torch.equal(out, unet_loaded_reference)
    torch.testing.assert_close(out, unet_reference)  # the freshly built model, up to that rounding


def test_unet_auto_map_without_a_disk_key_offloads_to_disk(
    on, unet_folder: Path, tmp_path: Path, unet_reference
) -> None:
    unet = UNet2DConditionModel.from_pretrained(
        str(unet_folder), device_map="auto", max_memory={"cpu": "300KB"}, offload_folder=str(tmp_path)
    )
    assert "disk" in unet.hf_device_map.values()
    assert hook_owner(unet) == {"bigmodel"}
    with torch.no_grad():
        assert torch.equal(unet(*unet_inputs()).sample, unet_reference)


@pytest.fixture(scope="module")
def vae_reference() -> tuple[torch.Tensor, torch.Tensor]:
    vae = tiny_vae()
    image = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return vae.encode(image).latent_dist.mean, vae.decode(latents()).sample


def test_vae_encode_decode_with_sequential_offload(on, vae_reference) -> None:
    from bigmodel import cpu_offload

    vae = tiny_vae()
    cpu_offload(vae, execution_device="cpu")
    image = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(vae.encode(image).latent_dist.mean, vae_reference[0])
        assert torch.equal(vae.decode(latents()).sample, vae_reference[1])


def test_vae_decode_runs_the_chained_offload_hook(on, vae_reference) -> None:
    # apply_forward_hook: decode() (not forward) must run the CpuOffload hook, which offloads the previous model.
    import accelerate

    unet, vae = tiny_unet(), tiny_vae()
    _, unet_hook = accelerate.cpu_offload_with_hook(unet, "cpu")
    _, vae_hook = accelerate.cpu_offload_with_hook(vae, "cpu", prev_module_hook=unet_hook)
    assert type(vae_hook).__module__.startswith("bigmodel")
    offloaded = []
    unet_hook.offload = lambda: offloaded.append("unet")  # records the call the hook chain makes
    with torch.no_grad():
        assert torch.equal(vae.decode(latents()).sample, vae_reference[1])
    assert offloaded == ["unet"]


def test_vae_loaded_with_disk_map_decodes_identically(on, tmp_path: Path, vae_reference) -> None:
    tiny_vae().save_pretrained(str(tmp_path / "vae"))
    vae = AutoencoderKL.from_pretrained(
        str(tmp_path / "vae"), device_map={"encoder": "disk", "decoder": "disk", "quant_conv": "cpu",
                                           "post_quant_conv": "cpu"}, offload_folder=str(tmp_path / "off"),
    )  # fmt: skip
    assert hook_owner(vae) == {"bigmodel"}
    with torch.no_grad():
        assert torch.equal(vae.decode(latents()).sample, vae_reference[1])
