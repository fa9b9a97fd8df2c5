"""The optimizer step: several masked-ratio updates per batch, AdamW with gradient clipping.

The trainer's weights are the policy; after each `train_step` the caller publishes them as the
next version. With `router_replay`, the MoE layers route every token to the experts the engine
chose when it sampled, so trainer and inference compute the same function even after the router's
weights have moved (the mismatch then comes only from the weights themselves).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from node.model.batching import GROUP_OVERHEAD_TOKENS
from node.model.checkpoint import InvalidCheckpoint, load_checkpoint, save_checkpoint, written_whole
from node.model.config import ModelConfig
from node.model.packed import Packed, varlen_usable
from node.model.qwen3_moe import CausalLM, ModelOutput
from node.rl.batch import TrainBatch, loss_rows, micro_batches
from node.rl.fp8 import apply_fp8_training
from node.recipe import DEFAULT as DEFAULT_RECIPE
from node.recipe import Recipe
from node.rl.loss import LossConfig, policy_loss, token_logprobs


MICRO_BATCH_TOKENS = 16_384
"""Default padded tokens per forward/backward: bounds activations and logits whatever the completions'
lengths (at SmolLM2's 49,152-token vocabulary in float32, 16,384 tokens of logits are 3 GiB; the tiny
model's test batches, a few thousand tokens, stay one micro-batch)."""


@dataclass
class TrainerConfig:
    """The optimizer's settings; those a run's recipe sets default to the recipe's (node/recipe.py)."""

    lr: float = DEFAULT_RECIPE.lr
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    updates_per_batch: int = DEFAULT_RECIPE.updates_per_batch
    """Passes over each batch (each a trust-region-masked update)."""
    minibatches: int = DEFAULT_RECIPE.minibatches
    """Optimizer steps per pass."""
    temperature: float = DEFAULT_RECIPE.temperature
    """Sampling temperature the engine used (logprobs are of logits / T)."""
    router_replay: bool = DEFAULT_RECIPE.router_replay
    """Route trainer tokens to the experts the engine chose."""
    fp8: bool = DEFAULT_RECIPE.train_fp8
    """Decoder projections and experts compute in block-scaled FP8 (`node.rl.fp8.apply_fp8_training`)."""
    decay_steps: int = 0
    """Cosine-decay the learning rate to lr * min_lr_ratio over this many steps (0: constant)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a share of lr under cosine decay."""
    micro_batch_tokens: int = MICRO_BATCH_TOKENS
    """Tokens one forward/backward takes at most (padded: rows x longest row): a minibatch of long
    completions is split into micro-batches whose gradients add up to the minibatch's (one optimizer step)."""
    pack: bool | str = "auto"
    """Micro-batches of sequences end to end in one row, no padding (`node.rl.batch.micro_batches` `pack`), each
    sequence attending to itself. "auto": where attention over them is one variable-length flash kernel, forward
    and backward (`node.model.packed.varlen_usable`: a GPU, 16-bit parameters); elsewhere right-padded rows
    (the CPU's packed attention is a loop over sequences)."""
    micro_batch_overhead_tokens: int | None | str = "auto"
    """What one more micro-batch is taken to cost, in padded tokens: the rows are grouped to pad least for it
    (`node.rl.batch.micro_batches`; None: the fewest micro-batches). "auto": `GROUP_OVERHEAD_TOKENS` on the
    CPU; the fewest micro-batches on a GPU (any device but the CPU). Measured (benchmarks.trainer_profile, 5.2B 8-layer
    30B-A3B shape, 256 long-tailed rows): on the H200 a step took 2.95 s with the fewest micro-batches, 3.60 s
    grouped for 2,048 tokens and 3.03 s for 16,384 (the forward/backward slower, the no-grad pass the step had then
    0.36 -> 0.23 s faster); on the 2-core CPU (tiny shape) grouping for 2,048 made the step 1.71x faster."""
    loss: LossConfig = field(default_factory=LossConfig)

    @classmethod
    def from_recipe(cls, recipe: Recipe, **overrides) -> "TrainerConfig":
        """The recipe's optimizer settings, its LR decayed over its steps; `overrides` on top."""
        return cls(**{"lr": recipe.lr, "decay_steps": recipe.steps, "temperature": recipe.temperature,
                      "updates_per_batch": recipe.updates_per_batch, "minibatches": recipe.minibatches,
                      "router_replay": recipe.router_replay, "fp8": recipe.train_fp8, **overrides})


def logprobs_at(model: CausalLM, batch: TrainBatch, rows: torch.Tensor, temperature: float, **forward
                ) -> tuple[torch.Tensor, ModelOutput]:
    """The model's logprobs of `batch`'s targets at flat positions `rows` (`loss_rows`), [B, T] with 0 elsewhere,
    and the forward's output (`forward`: its other arguments); the LM head and the log-softmax on those rows only."""
    b, t = batch.targets.shape
    out = model(batch.input_ids, logits_rows=rows, **forward)
    targets = batch.targets.reshape(-1).index_select(0, rows)
    # [N, 1, V]: `token_logprobs` takes its float32 chunks over the first dimension
    logp = token_logprobs(out.logits[:, None], targets[:, None], temperature)[:, 0]
    return logp.new_zeros(b * t).index_copy(0, rows, logp).view(b, t), out


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""What PyTorch's fused AdamW takes (every parameter on a GPU in one of them, else foreach)."""


class Trainer:
    def __init__(self, model: CausalLM, cfg: TrainerConfig = TrainerConfig()):
        self.model = apply_fp8_training(model) if cfg.fp8 else model  # in place: the same parameters and names
        self.cfg = cfg
        # fused on a GPU: one kernel reads and writes each parameter, gradient and moment once; the default
        # (foreach) makes about ten passes over them, 123 of 935 ms of a step's kernels at 1.87B (H100, s31)
        self.fused = all(p.is_cuda and p.dtype in FUSED_DTYPES for p in model.parameters())
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.99), fused=self.fused)
        self.step = 0
        self.distributed_checkpoint: Path | None = None
        """Set by `load` on a distributed checkpoint: its AdamW state is read when first needed
        (a world's ranks read their own shards of it instead; see `node.rl.parallel.world`)."""

    def _step_count(self, param: torch.Tensor, value) -> torch.Tensor:
        """AdamW's step count for `param` as the optimizer keeps it: a float32 scalar on the host, or beside the
        parameter when fused (the fused kernel reads it on the device)."""
        return torch.as_tensor(value, dtype=torch.float32).reshape(()).to(param.device if self.fused else "cpu")

    def logprobs(self, batch: TrainBatch, replay: bool | None = None, rows: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Trainer logprobs of the batch's targets at its loss positions, [B, T] (0 elsewhere: nothing reads
        them), and the aux loss. `rows`: `loss_rows` of the batch on its device, read by the caller before the
        batch went to the GPU (reading the mask there waits for the GPU)."""
        replay = self.cfg.router_replay if replay is None else replay
        # the LM head and the float32 log-softmax after it on the loss positions only: with a 49k-151k vocabulary
        # the log-sum-exp alone was 252 of 859 ms of a step's kernels (the 0.52B shape on an H100, s30), and a
        # long-tailed micro-batch's prompts and padding were most of its rows (37,400 padded positions for 14,201
        # loss tokens)
        rows = loss_rows(batch).to(batch.input_ids.device) if rows is None else rows
        packed = None if batch.packed is None else Packed.of(batch.packed, batch.input_ids.device)
        logp, out = logprobs_at(self.model, batch, rows, self.cfg.temperature, packed=packed,
                                routed_experts=batch.routed_experts if replay else None)
        return logp, out.aux_loss

    def micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """The pieces one forward and backward takes at a time (`node.rl.batch.micro_batches` by this
        config)."""
        return micro_batches(batch, self.cfg.micro_batch_tokens, self.overhead_tokens(), self.packs())

    def packs(self) -> bool:
        """Whether micro-batches are packed (`TrainerConfig.pack`, "auto" resolved by the parameters' device and
        dtype)."""
        if self.cfg.pack != "auto":
            return bool(self.cfg.pack)
        p = next(self.model.parameters())
        return varlen_usable(p.device, p.dtype)

    def overhead_tokens(self) -> int | None:
        """The micro-batch overhead in force (`TrainerConfig.micro_batch_overhead_tokens`, "auto" resolved
        by the model's device)."""
        overhead = self.cfg.micro_batch_overhead_tokens
        if overhead != "auto":
            return overhead
        return GROUP_OVERHEAD_TOKENS if next(self.model.parameters()).device.type == "cpu" else None

    def learning_rate(self) -> float:
        if self.cfg.decay_steps <= 0:
            return self.cfg.lr
        progress = min(self.step / self.cfg.decay_steps, 1.0)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.cfg.lr * (self.cfg.min_lr_ratio + (1 - self.cfg.min_lr_ratio) * cosine)

    def _on_device(self, micros: list[TrainBatch]) -> Iterator[tuple[TrainBatch, torch.Tensor, int]]:
        """(micro-batch on the model's device, its `loss_rows` there, its loss tokens) of host micro-batches:
        the figures are read on the host, so the step never waits for the GPU to learn them (each such wait
        empties the GPU's queue, and a launch-bound step then idles while the next kernels are launched)."""
        device = next(self.model.parameters()).device
        cuda = device.type == "cuda"  # pinned, so the copy queues behind the GPU's work instead of waiting for it
        for micro in micros:
            moved = micro.pinned().to(device, non_blocking=True) if cuda else micro.to(device)
            rows = loss_rows(micro)
            yield moved, (rows.pin_memory() if cuda else rows).to(device, non_blocking=cuda), len(rows)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One step on `batch`: its micro-batches cut and measured on the host, each moved to the model's device
        for its forward/backward (a trainer on a GPU: join --device cuda); nothing reads a GPU value before the
        last optimizer step is queued (the metrics, as tensors until then, are read at the end)."""
        if self.distributed_checkpoint is not None:
            self.load_pending_optimizer_state()
        batch = batch.to("cpu")
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        # `mismatch_kl` (the inference's logprobs against the policy's) is read from the first minibatch's own
        # forward, before any optimizer step: over its rows, a random 1/minibatches of the batch (all of it at one
        # minibatch). No separate no-grad pass over the batch for it: at 2 updates x 2 minibatches it took 0.131 s
        # of a 1.093 s step (0.52B, 256 long-tailed rows; 1.006 s without it: trainer_ab-nograd-h100-s32.json).
        metrics: dict[str, float | torch.Tensor] = {"lr": self.learning_rate()}
        for update in range(self.cfg.updates_per_batch):
            order = torch.randperm(len(batch))
            for rows in order.chunk(self.cfg.minibatches):
                self.optimizer.zero_grad(set_to_none=True)
                stats = self._accumulate(batch.select(rows))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
                self.optimizer.step()
                metrics.setdefault("mismatch_kl", stats["mismatch_kl"])
                metrics.update(loss=stats["loss"], masked_share=stats["masked_share"], grad_norm=grad_norm,
                               aux_loss=stats["aux_loss"])
        self.step += 1
        self.model.eval()
        return {k: float(v) for k, v in metrics.items()}  # the step's one wait for the GPU

    def _accumulate(self, mb: TrainBatch) -> dict[str, float]:
        """Gradients of one minibatch's loss, its micro-batches (`micro_batch_tokens`) one forward/backward
        each: each one's token-mean loss weighted by its share of the minibatch's loss tokens, so the
        gradients add up to the whole minibatch's (its load-balancing loss by its share of rows)."""
        aux_coef = self.model.config.router_aux_loss_coef
        micros = self.micro_batches(mb)
        n_all = max(1, int(mb.loss_mask.sum()))
        stats: dict[str, float | torch.Tensor] = dict.fromkeys(("loss", "masked_share", "mismatch_kl", "aux_loss"), 0.0)
        for micro, loss_at, n_tokens in self._on_device(micros):
            logp, aux = self.logprobs(micro, rows=loss_at)
            out = policy_loss(logp, micro.inference_logprobs, micro.advantages, micro.loss_mask, self.cfg.loss)
            tokens, rows = (1.0, 1.0) if len(micros) == 1 else (n_tokens / n_all, micro.sequences / mb.sequences)
            (out.loss * tokens + aux_coef * aux * rows).backward()
            stats["loss"] = stats["loss"] + out.loss.detach() * tokens
            stats["masked_share"] = stats["masked_share"] + out.masked_share * tokens
            stats["mismatch_kl"] = stats["mismatch_kl"] + out.mismatch_kl * tokens
            stats["aux_loss"] = stats["aux_loss"] + aux.detach() * rows
        return stats

    # ---- checkpoints: model as HF safetensors, optimizer state as safetensors + json -------
    def save(self, directory: str | Path, companions_from: str | Path | None = None) -> Path:
        """The model in the HF layout (with `companions_from`'s config fields, tokenizer files and chat
        template: the directory the run's model came from), AdamW's state and the step beside it; written
        whole or not at all (`written_whole`: `CheckpointNotWritten`, the previous checkpoint kept)."""
        directory = Path(directory)
        names = {id(p): n for n, p in self.model.named_parameters()}
        tensors, meta = {}, {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        tensors[f"{names[id(p)]}::{key}"] = value
                    else:
                        meta[f"{names[id(p)]}::{key}"] = float(value)
        need = sum(t.numel() * t.element_size() for t in (*self.model.state_dict().values(), *tensors.values()))
        with written_whole(directory, need) as staging:
            save_checkpoint(self.model, staging, metadata={"format": "pt", "step": str(self.step)},
                            companions_from=companions_from)
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(staging / "optimizer.safetensors"))
            (staging / "trainer.json").write_text(json.dumps({"step": self.step, "scalars": meta,
                                                              "config": asdict(self.cfg)}))
        return directory

    def load_pending_optimizer_state(self) -> None:
        """Read the AdamW state of the distributed checkpoint `load` came from (whole: one process)."""
        from node.rl.parallel.checkpoint import load_whole

        params = dict(self.model.named_parameters())
        _, state = load_whole(self.model, self.distributed_checkpoint, optimizer=True)
        for name, entry in state.items():
            p = params[name]
            self.optimizer.state[p] = {"step": self._step_count(p, entry["step"]),
                                       "exp_avg": entry["exp_avg"].to(p.device, p.dtype),
                                       "exp_avg_sq": entry["exp_avg_sq"].to(p.device, p.dtype)}
        self.distributed_checkpoint = None

    @classmethod
    def load(cls, directory: str | Path, cfg: TrainerConfig | None = None, run_model: ModelConfig | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "Trainer":
        """A `Trainer` checkpoint (`save`), or a distributed one (`node.rl.parallel.checkpoint`):
        then the weights are read now and the AdamW state at the first step (or by the world's
        ranks, each its own shards, when this trainer starts a `world.Leader`). `run_model`: the
        run's architecture, which the checkpoint must hold; the trainer then carries it as is (its
        max_position_embeddings is the run's cap, while a saved config.json keeps the source's). The model is
        made on `device` in `dtype` (a trainer role resumes where it trains, in the run's dtype) before its
        optimizer, which then holds its state beside the parameters."""
        directory = Path(directory)
        try:
            distributed = "distributed_checkpoint" in json.loads((directory / "trainer.json").read_text())
        except (OSError, ValueError):
            distributed = False
        trainer = (cls._load_distributed if distributed else cls._load_one)(directory, cfg, device, dtype)
        if run_model is not None:
            held = trainer.model.config.model_copy(update={"max_position_embeddings": run_model.max_position_embeddings})
            if held != run_model:
                raise InvalidCheckpoint(f"{directory} holds another model than the run's: "
                                        + "; ".join(f"{k}: {v!r} vs {getattr(run_model, k)!r}"
                                                    for k, v in held if v != getattr(run_model, k)))
            trainer.model.config = run_model
        return trainer

    @classmethod
    def _load_one(cls, directory: Path, cfg: TrainerConfig | None, device: str | torch.device,
                  dtype: torch.dtype) -> "Trainer":
        model = load_checkpoint(directory, dtype, device)
        try:
            state = json.loads((directory / "trainer.json").read_text())
            tensors = load_file(str(directory / "optimizer.safetensors"))
        except (OSError, ValueError) as exc:
            raise InvalidCheckpoint(f"trainer state in {directory} unreadable: {exc}") from exc
        trainer = cls(model, cfg or TrainerConfig(**{k: v for k, v in state["config"].items() if k != "loss"},
                                                  loss=LossConfig(**state["config"]["loss"])))
        params = dict(model.named_parameters())
        for key, value in tensors.items():
            name, field_name = key.split("::")
            trainer.optimizer.state[params[name]][field_name] = value.to(params[name].device, params[name].dtype)
        for key, value in state["scalars"].items():
            name, field_name = key.split("::")
            trainer.optimizer.state[params[name]][field_name] = (
                trainer._step_count(params[name], value) if field_name == "step" else torch.tensor(value))
        trainer.step = int(state["step"])
        return trainer

    @classmethod
    def _load_distributed(cls, directory: Path, cfg: TrainerConfig | None, device: str | torch.device,
                          dtype: torch.dtype) -> "Trainer":
        from node.model.config import InvalidModelConfig
        from node.rl.parallel.checkpoint import load_whole, read_meta

        meta = read_meta(directory)
        try:
            model = CausalLM(ModelConfig.from_file(directory / "config.json"))
        except InvalidModelConfig as exc:
            raise InvalidCheckpoint(str(exc)) from exc
        load_whole(model, directory, optimizer=False)
        model = model.to(device, dtype)
        saved = meta["config"]
        trainer = cls(model, cfg or TrainerConfig(**{k: v for k, v in saved.items() if k != "loss"},
                                                  loss=LossConfig(**saved["loss"])))
        trainer.step = int(meta["step"])
        trainer.distributed_checkpoint = directory
        return trainer
