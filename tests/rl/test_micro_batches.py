"""The trainer's loss/backward in micro-batches by a token budget (node/rl/batch.py micro_batches): no
forward takes more padded tokens than the budget, and the step equals the one-forward step."""

import copy
import math

import pytest
import torch

from node.envs.rollout import Rollout
from node.model.qwen3_moe import CausalLM
from node.model.tiny import TinyMoE
from node.model.tokenizer import CharTokenizer
from node.rl.batch import build_batch, micro_batches
from node.rl.trainer import Trainer, TrainerConfig

CFG = TinyMoE(hidden=32, layers=2, experts=4, top_k=2, seed=0).config(CharTokenizer().vocab_size)


def long_tailed_batch():
    """8 rollouts, completions of 3 to 40 tokens (a long tail), prompts of 5."""
    g = torch.Generator().manual_seed(0)
    rollouts = []
    for i, n in enumerate([3, 4, 5, 6, 8, 12, 20, 40]):
        ids = torch.randint(3, CFG.vocab_size, (5 + n,), generator=g).tolist()
        rollouts.append(Rollout(f"e{i}", None, ids[:5], ids[5:], [True] * n, (-2.0 * torch.rand(n, generator=g)).tolist()))
    return build_batch(rollouts, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.3, -0.3])


def test_micro_batches_stay_within_the_budget_and_cover_every_loss_token_once():
    batch = long_tailed_batch()
    assert micro_batches(batch, 10_000) == [batch]  # fits: the batch itself
    micros = micro_batches(batch, 64)
    assert len(micros) > 1
    assert all(m.input_ids.numel() <= 64 or len(m) == 1 for m in micros)
    assert sum(int(m.loss_mask.sum()) for m in micros) == int(batch.loss_mask.sum())
    assert sorted(float(m.advantages[r, 0]) for m in micros for r in range(len(m))) == \
        sorted(batch.advantages[:, 0].tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_micro_batches_of_a_batch_on_the_gpu():
    """The trainer splits its batch where it is, on its GPU (the H200 run on long completions died here:
    a position index made on the host against the batch's mask on the device, session 13)."""
    batch = long_tailed_batch()
    micros = micro_batches(batch.to("cuda"), 64)
    assert [m.input_ids.shape for m in micros] == [m.input_ids.shape for m in micro_batches(batch, 64)]
    assert all(m.input_ids.device.type == "cuda" for m in micros)


def test_a_step_in_micro_batches_equals_the_one_forward_step_and_no_forward_exceeds_the_budget():
    cfg = CFG.model_copy(update={"router_aux_loss_coef": 0.0})  # its share is by rows, an approximation
    torch.manual_seed(0)
    model = CausalLM(cfg)
    batch = long_tailed_batch()
    results = []
    for budget in (10_000, 64):
        trainer = Trainer(copy.deepcopy(model), TrainerConfig(lr=1e-2, updates_per_batch=2, minibatches=2,
                                                              router_replay=False, micro_batch_tokens=budget))
        seen: list[int] = []
        trainer.model.register_forward_pre_hook(lambda m, args: seen.append(args[0].numel()))
        torch.manual_seed(1)  # the same minibatch permutations
        metrics = trainer.train_step(batch)
        results.append((trainer.model.state_dict(), metrics, seen))
    (whole, m_whole, seen_whole), (micro, m_micro, seen_micro) = results
    assert max(seen_whole) > 64 and max(seen_micro) <= 64 and len(seen_micro) > len(seen_whole)
    for name in whole:
        torch.testing.assert_close(micro[name], whole[name], rtol=1e-5, atol=1e-6)
    for key in ("loss", "masked_share", "mismatch_kl"):
        assert abs(m_micro[key] - m_whole[key]) < 1e-5, key


def test_the_auto_micro_batch_overhead_groups_on_the_cpu_and_takes_the_fewest_for_a_gpu_backward():
    """`TrainerConfig.micro_batch_overhead_tokens = "auto"`: grouped to pad least for `GROUP_OVERHEAD_TOKENS` on
    the CPU, the fewest micro-batches for a GPU's forward/backward (measured on the H200: 2.95 s a step against
    3.60 s grouped); an explicit value holds on either."""
    from node.model.batching import GROUP_OVERHEAD_TOKENS

    trainer = Trainer(CausalLM(CFG), TrainerConfig(micro_batch_tokens=64))
    assert trainer.cfg.micro_batch_overhead_tokens == "auto"
    assert trainer.overhead_tokens() == GROUP_OVERHEAD_TOKENS
    batch = long_tailed_batch()
    assert [m.input_ids.shape for m in trainer.micro_batches(batch)] == \
        [m.input_ids.shape for m in micro_batches(batch, 64, GROUP_OVERHEAD_TOKENS)]
    for fixed in (None, 0, 512):
        t = Trainer(CausalLM(CFG), TrainerConfig(micro_batch_overhead_tokens=fixed))
        assert t.overhead_tokens() == fixed
    with torch.device("meta"):  # a model off the CPU (what a GPU's trainer holds), no memory taken
        off_cpu = Trainer(CausalLM(CFG), TrainerConfig())
    assert off_cpu.overhead_tokens() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_step_waits_for_the_gpu_only_to_read_its_metrics_whatever_its_micro_batches():
    """Reading a GPU value (`.item()`, `float`, a copy to the host) empties the GPU's queue: in a launch-bound
    step the GPU then idles while the next kernels are launched. The step's figures are read on the host and its
    metrics once, at the end: the waits do not grow with the micro-batches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Waits(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            aten = torch.ops.aten
            if func is aten._local_scalar_dense.default:
                self.n += args[0].is_cuda
            elif func is aten._to_copy.default:
                self.n += args[0].is_cuda and kwargs.get("device") == torch.device("cpu")
            elif func is aten.copy_.default:
                self.n += args[1].is_cuda and args[0].device.type == "cpu"
            return func(*args, **kwargs)

    torch.manual_seed(0)
    batch = long_tailed_batch()
    counts = []
    for budget in (10_000, 64):  # one micro-batch, then several
        # bf16: the grouped expert GEMMs (float32 experts count their rows on the host: a wait per MoE layer)
        trainer = Trainer(CausalLM(CFG).to("cuda", torch.bfloat16), TrainerConfig(lr=1e-3, micro_batch_tokens=budget))
        trainer.train_step(batch)  # warm: optimizer states, kernels
        waits = Waits()
        with waits:
            metrics = trainer.train_step(batch)
        counts.append(waits.n)
        assert all(math.isfinite(v) for v in metrics.values())  # the figures came back
    assert counts[0] == counts[1] <= 6, counts  # the five metrics read at the end (mismatch_kl, loss, ...)


def test_the_trainer_computes_logits_at_loss_positions_only_and_they_are_the_full_forwards():
    """`Trainer.logprobs`: the LM head takes the loss positions' rows only (no prompt or padding row of a long-tailed
    batch), and their logprobs are those of the whole [B, T, V] forward; every other position is 0."""
    from node.rl.loss import token_logprobs

    torch.manual_seed(0)
    model = CausalLM(CFG)
    batch = long_tailed_batch()
    trainer = Trainer(model, TrainerConfig(router_replay=False))
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            logp, _ = trainer.logprobs(batch)
    finally:
        hook.remove()
    mask = batch.loss_mask
    assert seen == [int(mask.sum())] and int(mask.sum()) < mask.numel() / 2
    with torch.no_grad():
        whole = token_logprobs(model(batch.input_ids).logits, batch.targets)
    assert torch.allclose(logp[mask], whole[mask], atol=1e-5)
    assert torch.equal(logp[~mask], torch.zeros(int((~mask).sum())))


def test_the_mismatch_is_the_first_minibatchs_before_any_update_without_a_pass_of_its_own():
    """`mismatch_kl` comes from the first minibatch's own forward, under the policy the step started from: the
    step makes no forward beyond its updates' (2 updates x 2 minibatches: 4), and the figure is the first
    minibatch's rows' mismatch under the unchanged model (not the whole batch's, not one after an update)."""
    from node.rl.loss import policy_loss

    cfg = CFG.model_copy(update={"router_aux_loss_coef": 0.0})
    torch.manual_seed(0)
    model = CausalLM(cfg)
    batch = long_tailed_batch()
    trainer = Trainer(copy.deepcopy(model), TrainerConfig(lr=1e-2, updates_per_batch=2, minibatches=2,
                                                          router_replay=False))
    forwards: list[int] = []
    trainer.model.register_forward_pre_hook(lambda m, args: forwards.append(args[0].shape[0]))
    torch.manual_seed(1)
    first = torch.randperm(len(batch)).chunk(2)[0]  # the rows the step's first minibatch takes
    torch.manual_seed(1)
    metrics = trainer.train_step(batch)
    assert len(forwards) == 4 and forwards[0] == len(first)

    def mismatch(rows: torch.Tensor) -> float:
        before = Trainer(copy.deepcopy(model), trainer.cfg)
        mb = batch.select(rows)
        with torch.no_grad():
            logp = before.logprobs(mb, replay=False)[0]
        out = policy_loss(logp, mb.inference_logprobs, mb.advantages, mb.loss_mask, trainer.cfg.loss)
        return float(out.mismatch_kl)

    assert metrics["mismatch_kl"] == pytest.approx(mismatch(first), rel=1e-5, abs=1e-8)
    assert abs(mismatch(torch.arange(len(batch))) - mismatch(first)) > 1e-4  # the whole batch's reads otherwise


def test_a_packed_step_equals_the_padded_step_and_its_forwards_take_no_padding():
    """`TrainerConfig.pack`: each micro-batch is one row of sequences end to end (each attending to itself), within
    the token budget; the step's weights and figures are the padded step's, and its forwards take each sequence's
    tokens up to its last loss position and nothing else."""
    from node.rl.batch import row_lengths

    cfg = CFG.model_copy(update={"router_aux_loss_coef": 0.0})  # the padded step's counts its padding's routes
    torch.manual_seed(0)
    model = CausalLM(cfg)
    batch = near_policy(model, long_tailed_batch())
    results = []
    for pack in (False, True):
        trainer = Trainer(copy.deepcopy(model), TrainerConfig(lr=1e-2, updates_per_batch=2, minibatches=2,
                                                              router_replay=False, micro_batch_tokens=64, pack=pack))
        assert trainer.packs() is pack
        seen: list[tuple[int, ...]] = []
        trainer.model.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
        torch.manual_seed(1)  # the same minibatch permutations
        metrics = trainer.train_step(batch)
        results.append((trainer.model.state_dict(), metrics, seen))
    (padded, m_padded, seen_padded), (packed, m_packed, seen_packed) = results
    real = 2 * sum(row_lengths(batch))  # 2 updates, each over every row once
    assert all(b == 1 for b, _ in seen_packed) and sum(n for _, n in seen_packed) == real
    assert sum(b * n for b, n in seen_padded) > real
    longest = max(row_lengths(batch))
    assert all(n <= 64 or n == longest for _, n in seen_packed)
    moved = sum(float((padded[n] - p).abs().max()) for n, p in model.state_dict().items())
    assert moved > 1e-3  # the step learned (near-policy logprobs: the trust region kept its tokens)
    for name in padded:  # AdamW's first steps move a weight by about lr = 1e-2 whatever its gradient's size; the sums
        # of a packed and a padded forward round differently (on one AMD EPYC host one of 4,096 weights was 1.05e-5 apart)
        torch.testing.assert_close(packed[name], padded[name], rtol=1e-4, atol=5e-5)
    for key in ("loss", "masked_share", "mismatch_kl"):
        assert abs(m_packed[key] - m_padded[key]) < 1e-5, key


def near_policy(model: CausalLM, batch):
    """`batch` with inference logprobs near `model`'s own (so the trust region keeps most tokens: a step learns)."""
    with torch.no_grad():
        own, _ = Trainer(copy.deepcopy(model), TrainerConfig(router_replay=False, pack=False)).logprobs(batch)
    noise = 0.05 * torch.randn(own.shape, generator=torch.Generator().manual_seed(2)).to(own.device)
    batch.inference_logprobs = (own.float() + noise).where(batch.loss_mask, 0.0)
    return batch


def test_packed_logprobs_replay_each_sequences_routes_and_equal_the_padded_ones():
    """A packed micro-batch carries its rows' routes end to end: router replay gives each token the experts its own
    row chose (random routes here, far from what the router would pick), as the padded batch does."""
    from node.rl.batch import pack_rows, row_lengths

    torch.manual_seed(0)
    model = CausalLM(CFG)
    batch = long_tailed_batch()
    b, t = batch.input_ids.shape
    moe_layers = sum(CFG.is_moe_layer(i) for i in range(CFG.num_hidden_layers))
    batch.routed_experts = torch.stack([torch.randperm(CFG.num_experts)[:CFG.num_experts_per_tok]
                                        for _ in range(b * t * moe_layers)]).view(b, t, moe_layers, -1)
    trainer = Trainer(model, TrainerConfig(router_replay=True))
    lengths = row_lengths(batch)
    one = pack_rows(batch, list(range(b)), lengths)
    assert one.packed == tuple(lengths) and one.input_ids.shape == (1, sum(lengths)) and one.sequences == b
    with pytest.raises(ValueError, match="packed"):
        one.select(torch.tensor([0]))
    with torch.no_grad():
        padded, _ = trainer.logprobs(batch)
        packed, _ = trainer.logprobs(one)
        free, _ = trainer.logprobs(one, replay=False)
    keep = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    mask = one.loss_mask[0]
    torch.testing.assert_close(packed[0][mask], padded[keep][mask], rtol=1e-5, atol=1e-5)
    assert (free[0][mask] - packed[0][mask]).abs().max() > 1e-3  # the replayed routes made the difference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_trainer_packs_by_default_and_its_gradients_are_the_padded_ones():
    """On a GPU in bf16 the micro-batches are packed ("auto": one variable-length flash kernel forward and
    backward); the loss and the gradients (one update of one minibatch, learning rate 0: the weights stay) agree
    with the padded step's within bf16's rounding."""
    cfg = CFG.model_copy(update={"router_aux_loss_coef": 0.0})
    torch.manual_seed(0)
    model = CausalLM(cfg).to("cuda", torch.bfloat16)
    batch = near_policy(model, long_tailed_batch().to("cuda")).to("cpu")
    results = []
    for pack in ("auto", False):
        trainer = Trainer(copy.deepcopy(model), TrainerConfig(lr=0.0, updates_per_batch=1, minibatches=1,
                                                              router_replay=False, micro_batch_tokens=64, pack=pack))
        assert trainer.packs() is (pack == "auto")
        metrics = trainer.train_step(batch)
        grads = torch.cat([p.grad.float().flatten() for p in trainer.model.parameters() if p.grad is not None])
        results.append((metrics, grads))
    (m_packed, g_packed), (m_padded, g_padded) = results
    assert abs(m_packed["loss"] - m_padded["loss"]) < 2e-2 * max(1.0, abs(m_padded["loss"]))
    assert g_packed.shape == g_padded.shape and g_padded.norm() > 0 and m_padded["masked_share"] < 0.5
    assert torch.nn.functional.cosine_similarity(g_packed, g_padded, dim=0) > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gpu_token_logprobs_kernel_is_the_torch_function_forward_and_backward(dtype):
    """`TokenLogprobs` (what `token_logprobs` runs under autograd on a GPU) against the chunked torch ops at Qwen3's
    151,936 words and a temperature: the same logprobs and the same gradient of the logits."""
    from node.rl.loss import _chunk_logprobs, token_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(37, 151_936, generator=g, device="cuda")).to(dtype)
    targets = torch.randint(0, 151_936, (37,), generator=g, device="cuda")
    weights = torch.randn(37, generator=g, device="cuda")
    got_in = logits.clone().requires_grad_()
    got = token_logprobs(got_in[:, None], targets[:, None], 0.7)[:, 0]
    (got * weights).sum().backward()
    want_in = logits.clone().requires_grad_()
    want = _chunk_logprobs(want_in, targets, 0.7)
    (want * weights).sum().backward()
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    assert got_in.grad.dtype == dtype
    scale = want_in.grad.float().abs().max()
    assert (got_in.grad.float() - want_in.grad.float()).abs().max() <= 1e-2 * scale
    assert torch.allclose(got_in.grad.float().sum(1), torch.zeros(37, device="cuda"), atol=1e-2 * float(scale))
    from node.rl import logprob_kernels

    assert logprob_kernels.usable(logits.device, dtype)  # the check the trainer's path made passed
