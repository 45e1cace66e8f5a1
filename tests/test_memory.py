"""The GPU memory account of the layerwise engine at real shapes (engine/memory.py), from the real configs in
tests/data and the release recipes: what one Kimi K2 or GLM-5 layer holds on an H200 and an H100 with 512 samples
of 2048 tokens, the offload it must choose, and the line it prints. Pure arithmetic: no GPU, no weights."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import RECIPES

from quantize import recipe, serving
from quantize.arch.layout import from_config
from quantize.engine import agreement, experts, memory
from quantize.engine import tune as tune_

DATA = Path(__file__).parent / "data"
MIB = 2**20
H200, H100 = (143771 - 1024) * MIB, (81559 - 1024) * MIB  # nvidia-smi's totals, less a CUDA context
HOST = 1536 * 2**30  # a GPU box's free host memory
TOKENS, SEQ = 512 * 2048, 2048


def layers(config: str, recipe_name: str, tune=(0, 0)) -> tuple[list[memory.Layer], int]:
    """The decoder layers of the config under the recipe (targets as tensor_plan.build picks them), GPTQ, bf16."""
    model, layout = from_config(json.loads((DATA / config).read_text()))
    r = recipe.load(RECIPES / f"{recipe_name}.yaml")
    entries = []
    for name, shape in layout:
        role = model.role(name, len(shape))
        targeted = r.targets_module(role.module, role.linear) and not serving.keep_float(model.arch.family,
                                                                                         role.module, False)
        entries.append(SimpleNamespace(tensor=SimpleNamespace(name=name, shape=shape), role=role,
                                       action="quantize" if targeted else "keep"))
    gpu = torch.device("cuda")

    def stack_of(inter, hidden):
        return experts.stack_size(inter, hidden, torch.bfloat16, gpu) * experts.expert_bytes(inter, hidden, torch.bfloat16)

    tc = model.text_config
    dsa = model.arch.family == "glm_moe_dsa"
    return memory.layers_of(entries, 2, stack_of, True, carry=8 * (tc.get("index_topk") or 0) * dsa,
                            index_heads=(tc.get("index_n_heads") or 0) * dsa, tune=tune,
                            grid=r.scheme.grid), model.hidden_size


def reading(config, recipe_name, free, rank=0, host_free=HOST, host="node-a", comm=0) -> agreement.Reading:
    """What a rank on a GPU with `free` bytes reads of its memory (layerwise.memory_reading, at real shapes)."""
    ls, hidden = layers(config, recipe_name)
    accounts = {k: memory.account(ls, TOKENS, SEQ, hidden, 2, k, f"cuda:{rank}", free, memory.GIB // 4, comm)
                for k in agreement.KINDS}
    need = {k: 2 * memory.host_bytes(ls, TOKENS, hidden, 2) if k == "cpu" else 0 for k in agreement.KINDS}
    return agreement.Reading(rank, f"cuda:{rank}", host, host_free, accounts, need)


def choose(config, recipe_name, free, offload="auto"):
    r = reading(config, recipe_name, free)
    return r.accounts[agreement.decide([r], offload)[0]]


@pytest.mark.parametrize("config, recipe_name, gpu, free, offload, total", [
    ("kimi-k2-instruct-config.json", "kimi-k2-w4a16", "H200", H200, "gpu", 101.9),
    ("kimi-k2-instruct-config.json", "kimi-k2-w4a16", "H100", H100, "cpu", 31.9),
    ("glm-5-fp8-config.json", "glm-w4a16", "H200", H200, "gpu", 108.2),
    ("glm-5-fp8-config.json", "glm-w4a16", "H100", H100, "cpu", 32.2),
])
def test_a_layer_at_512_x_2048_tokens_chooses_its_offload_by_what_the_gpu_holds(config, recipe_name, gpu, free, offload,
                                                                                total):
    a = choose(config, recipe_name, free)
    assert a.offload == offload and memory.fits(a)
    assert round(a.total / memory.GIB, 1) == total, a.line()
    # counted whatever the offload: the stack of routed experts (Kimi: 26 of 1.28 GB), the layer's other weights
    assert a.parts["expert stack"] > 30 * memory.GIB and a.parts["layer weights"] < memory.GIB
    line = a.line()
    assert line.startswith(f"cuda:0: {total} GiB of {free / memory.GIB:.1f} GiB free for layer ") and " GiB)" in line
    if offload == "gpu":  # the activations, which offload moves: hidden states, the MoE inputs twice, the sums
        assert a.parts["hidden states"] == TOKENS * (7168 if "kimi" in config else 6144) * 2
        assert a.parts["MoE inputs (2 passes)"] == a.parts["routed sums"] == 2 * a.parts["hidden states"]
        assert "activations on the GPU" in line
    else:
        assert "hidden states" not in a.parts and "activations in host memory" in line
    if "glm-5" in config and offload == "gpu":  # DSA's top-k indices: 2048 int64 a token, 16 GiB at 1M tokens
        assert a.parts["top-k carry"] == TOKENS * 2048 * 8


def test_an_offload_that_cannot_fit_is_refused_with_its_numbers():
    a = choose("kimi-k2-instruct-config.json", "kimi-k2-w4a16", H100, offload="gpu")  # asked for, 101.9 GiB
    assert not memory.fits(a)
    msg = memory.refusal(a)
    assert msg.startswith("layer 1 needs 101.9 GiB on cuda:0 with activations offloaded to gpu (")
    assert "78.6 GiB is free" in msg and "--offload cpu" in msg
    small = choose("kimi-k2-instruct-config.json", "kimi-k2-w4a16", 24 * memory.GIB)  # not even the stack fits
    assert small.offload == "cpu" and not memory.fits(small) and "expert stack 31.1" in memory.refusal(small)


KIMI = ("kimi-k2-instruct-config.json", "kimi-k2-w4a16")


def test_eight_ranks_run_under_one_offload_even_when_one_gpu_has_less_free():
    """Each rank used to choose its offload from its own free memory: rank 3 with less free than an H200's
    `gpu` needs went to `cpu` while the others stayed on `gpu`, and their messages no longer paired. The ranks'
    readings are decided once, for all: the first kind every rank fits."""
    readings = [reading(*KIMI, H200, rank=r) for r in range(8)]
    assert agreement.decide(readings, "auto") == ("gpu", None)
    readings[3] = reading(*KIMI, H100, rank=3)
    assert agreement.decide(readings, "auto") == ("cpu", None)
    kind, why = agreement.decide(readings, "gpu")  # asked for: refused, naming the rank that cannot
    assert kind == "gpu" and why.startswith("rank 3 (cuda:3): layer 1 needs 101.9 GiB on cuda:3")


def test_the_ranks_of_one_host_share_its_free_memory():
    """`cpu` offload keeps each rank's activations in host memory: 8 ranks of one host each get an eighth of its
    free memory, not all of it (ranks on two hosts each have their own)."""
    need = reading(*KIMI, H100).host_need["cpu"]
    enough_for_one = int(need * 1.5)
    one_host = [reading(*KIMI, H100, rank=r, host_free=enough_for_one) for r in range(8)]
    assert agreement.decide(one_host[:1], "auto") == ("cpu", None)
    kind, why = agreement.decide(one_host, "auto")
    assert kind == "disk" and why is None  # disk offload holds no activations on the host
    kind, why = agreement.decide(one_host, "cpu")
    assert "rank 0 (cuda:0): the host needs" in why and "whose 8 ranks share it" in why
    apart = [reading(*KIMI, H100, rank=r, host_free=enough_for_one, host=f"node-{r}") for r in range(8)]
    assert agreement.decide(apart, "cpu") == ("cpu", None)


def test_nccl_communicators_are_counted_in_the_account():
    plain = reading(*KIMI, H200).accounts["gpu"]
    counted = reading(*KIMI, H200, comm=memory.nccl_bytes(8, 0)).accounts["gpu"]
    assert counted.parts["NCCL communicators"] == memory.nccl_bytes(8, 0) > 0
    assert counted.total == plain.total + memory.nccl_bytes(8, 0)


def test_the_tuning_after_gptq_is_counted_for_kimis_dense_layer_and_fits_an_h200():
    """engine/tune.py tunes the dense layers (Kimi K2 has one: hidden 7168, MLP 18432, MLA) on rank 0 when they are
    quantized (every Linear INT4; Moonshot's recipe keeps them BF16): float32 values, offsets and their gradients
    for each weight, a step's forward kept for its backward, and the tuned samples' targets and attention contexts.
    The MoE layers are not tuned and count nothing for it."""
    ls, hidden = layers("kimi-k2-instruct-config.json", "dense-w4a16", tune=(4, 32))
    dense = [x for x in ls if not x.moe]
    assert [x.index for x in dense] == [0] and all(x.tune == (0, 0) for x in ls if x.moe)
    parts = memory.layer_parts(dense[0], TOKENS, SEQ, hidden, 2, False, 0)
    weights = dense[0].weights // 2
    assert weights > 450e6  # its MLA attention and its dense MLP
    assert parts["tuning"] > weights * memory.TUNE_BYTES_PER_WEIGHT
    assert 12 * memory.GIB < parts["tuning"] < 24 * memory.GIB
    a = memory.account(ls, TOKENS, SEQ, hidden, 2, "cpu", "cuda:0", H200, memory.GIB // 4)
    assert memory.fits(a) and a.total < H200 // 2  # the expert stacks of a MoE layer still weigh more
    untuned, _ = layers("kimi-k2-instruct-config.json", "dense-w4a16")
    assert "tuning" not in memory.layer_parts(untuned[0], TOKENS, SEQ, hidden, 2, False, 0)


def test_the_last_dense_layers_tuning_counts_the_logit_head_it_measures_through(tmp_path):
    """engine/tune.py measures the last tune.HEAD_LAYERS layers' error through lm_head (tune.Head): each of a dense
    Llama-3-70B's last four layers holds its 128256 x 8192 weight twice (bf16 and float32) and an 8192^2 Fisher
    matrix, 6.6 GiB more than its other layers; Kimi's last layers are MoE, never tuned, and count none."""
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
           "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
    (tmp_path / "llama.json").write_text(json.dumps(cfg))
    ls, hidden = layers(str(tmp_path / "llama.json"), "dense-w4a16", tune=(4, 32))
    parts = [memory.layer_parts(x, TOKENS, SEQ, hidden, 2, False, 0) for x in ls]
    assert tune_.HEAD_LAYERS == 4
    assert [p["logit head"] for p in parts[:-4]] == [0] * 76
    assert [p["logit head"] for p in parts[-4:]] == [memory.head_bytes(128256, 8192, 2)] * 4
    assert 6 * memory.GIB < parts[-1]["logit head"] < 7 * memory.GIB
    assert memory.account(ls, TOKENS, SEQ, hidden, 2, "cpu", "cuda:0", H200, memory.GIB // 4).layer == 76  # the first
    kimi, _ = layers("kimi-k2-instruct-config.json", "dense-w4a16", tune=(4, 32))
    assert all(x.head == 0 for x in kimi)
