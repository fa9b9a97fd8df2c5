"""`primerl-node verify` in a real process: honest claims accepted, a tampered one rejected, signed."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import rollouts as R  # noqa: E402

from node.model import save_checkpoint  # noqa: E402
from verification.proof import prove_rollouts  # noqa: E402
from verification.verdict import Verdict  # noqa: E402


def test_verify_command_prints_signed_verdicts_for_a_checkpoint(tmp_path):
    model = R.tiny_model()
    ckpt = save_checkpoint(model, tmp_path / "v0")
    manifest = hashlib.sha256(b"v0-manifest").digest()
    work = [(s, R.spec(s)) for s in range(4)]
    comps = R.generate(R.engine_for(model), work)
    claims = R.claims_from(comps, work)
    proofs = prove_rollouts([(c.hidden, c.versions) for c in comps], {0: manifest})
    claims = [c.model_copy(update={"proof": p}) for c, p in zip(claims, proofs)]
    claims[2] = claims[2].model_copy(update={"reward": claims[2].reward + 0.5})
    claims[3] = claims[3].model_copy(update={"engine": "vllm"})  # honest tokens, labelled as vLLM's
    lines = [c.model_dump_json() for c in claims] + ["{not json"]
    (tmp_path / "claims.jsonl").write_text("\n".join(lines) + "\n")

    def verify(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "node.cli", "verify", "--checkpoint", str(ckpt), "--claims", str(tmp_path / "claims.jsonl"),
             "--manifest-hash", manifest.hex(), "--key", str(tmp_path / "validator.key"), "--max-seq-len", str(R.MAX_SEQ),
             *extra], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])

    out = verify()
    assert out.returncode == 0, out.stderr[-2000:]
    verdicts = [Verdict.model_validate(json.loads(line)) for line in out.stdout.splitlines()]
    assert [v.accepted for v in verdicts] == [True, True, False, False]
    assert verdicts[2].reason.value == "reward_mismatch"
    assert verdicts[3].reason.value == "engine_not_allowed"  # the run (default) accepts built-in rollouts only
    for v in verdicts:
        v.check_signature()
    out = verify("--engines", "builtin,vllm")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [json.loads(line)["accepted"] for line in out.stdout.splitlines()] == [True, True, False, True]
    bad = verify("--engines", "sglang")
    assert bad.returncode == 2 and "engines must be among" in bad.stderr
