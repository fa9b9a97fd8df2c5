"""`primerl-node verify`: check rollout claims (JSON lines) against a policy checkpoint and print
one signed verdict per claim (JSON lines). The built-in environments and char tokenizer are used.

    primerl-node verify --checkpoint DIR --claims claims.jsonl [--version 0] [--manifest-hash HEX] [--key FILE]
                        [--fp8 off|experts|all]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

from protocol.model_spec import FP8_MODES

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="verify rollout claims against a checkpoint; print signed verdicts")
    p.add_argument("--checkpoint", required=True, help="policy checkpoint directory (config.json + safetensors)")
    p.add_argument("--claims", required=True, help="JSON lines, one verification.claim.RolloutClaim each")
    p.add_argument("--version", type=int, default=0, help="policy version the checkpoint is")
    p.add_argument("--manifest-hash", default=None,
                   help="hex sha256 of the version's manifest (default: sha256 of the safetensors file)")
    p.add_argument("--key", default=None, help="validator key file (created if missing); unsigned without")
    p.add_argument("--max-seq-len", type=int, default=None, help="engine sequence limit (default: model's)")
    p.add_argument("--engines", type=_engines, default=("builtin",),
                   help="engines whose rollouts the run accepts, comma-separated (its spec's `engines`; "
                        "default builtin): a claim naming another is rejected (engine_not_allowed)")
    p.add_argument("--fp8", choices=FP8_MODES, default="off",
                   help="the run's serving precision (its spec's model.fp8): recompute with the same block-scaled "
                        "e4m3 weights and judge with that precision's thresholds (docs/fp8.md)")
    p.set_defaults(func=run)


def _engines(text: str) -> tuple[str, ...]:
    from typing import get_args

    from protocol.messages import EngineName

    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [n for n in names if n not in get_args(EngineName)]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"engines must be among {', '.join(get_args(EngineName))}; got {text!r}")
    return names


def run(args: argparse.Namespace) -> int:
    from protocol.identity import NodeKey
    from node.model import CharTokenizer, load_checkpoint
    from node.model.tokenizer import HFTokenizer
    from node.replay import TorchReference, env_oracle
    from verification.claim import RolloutClaim
    from verification.validator import verify_claims

    from node.engine.fp8.model import apply_fp8_mode

    model = apply_fp8_mode(load_checkpoint(args.checkpoint), args.fp8)
    if args.manifest_hash:
        manifest = bytes.fromhex(args.manifest_hash)
    else:
        weights = next(Path(args.checkpoint).glob("*.safetensors"))
        manifest = hashlib.sha256(weights.read_bytes()).digest()
    # the checkpoint's own tokenizer when it has one (a real model), else the tiny model's characters
    tok = HFTokenizer(args.checkpoint) if (Path(args.checkpoint) / "tokenizer.json").exists() else CharTokenizer()
    prompt_ids, reward = env_oracle(tok)
    ref = TorchReference({args.version: (model, manifest)}, eos_id=tok.eos_id,
                         max_seq_len=args.max_seq_len or model.config.max_position_embeddings, decode=tok.decode,
                         tasks=prompt_ids, reward=reward)
    claims = []
    for n, line in enumerate(Path(args.claims).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            claims.append(RolloutClaim.model_validate_json(line))
        except ValueError as exc:
            log.warning("claims line %d is not a valid claim: %s", n, str(exc)[:200])
    key = NodeKey.load_or_create(args.key) if args.key else None
    for verdict in verify_claims(claims, ref, key, engines=args.engines):
        sys.stdout.write(json.dumps(json.loads(verdict.model_dump_json())) + "\n")
    return 0
