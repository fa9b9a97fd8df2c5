"""The model spec travels in the signed run spec and run.toml; every role builds version 0 from it."""

import pytest
import torch

from node.model.errors import UnknownModelName, WeightsHashMismatch
from node.model.spec import weights_hash
from node.roles.common import check_device, fresh_model, model_config, tokenizer
from node.run_config import InvalidRunConfig, RunConfig, to_toml
from protocol.messages import RunSpec, encode_message
from protocol.model_spec import ModelSpec

PEER = "12D3KooWGzh1b2VJ2c8Nk5rQb9P9s1p7pY9yq1Qe4sXvTtF3gW8E"


def _spec(**kw) -> RunSpec:
    return RunSpec(run_id="r", coordinator=PEER, environment="reverse", **kw)


def test_default_model_keeps_spec_bytes_and_old_string_specs_still_parse():
    plain = _spec()
    assert b'"model"' not in encode_message(plain)  # tiny-moe: omitted, as before the field existed
    assert _spec(model="").model == ModelSpec()
    named = _spec(model="smollm2-135m-instruct")
    assert named.model.source == "smollm2-135m-instruct" and b'"model"' in encode_message(named)
    again = RunSpec.model_validate_json(encode_message(named))
    assert again == named and again.spec_hash() == named.spec_hash() != plain.spec_hash()


def test_fp8_serving_is_signed_in_the_spec_and_off_keeps_every_existing_specs_bytes(tmp_path):
    named = _spec(model="smollm2-135m-instruct")
    assert b"fp8" not in encode_message(named) and b"fp8" not in encode_message(_spec())  # off: bytes as before
    fp8 = _spec(model=ModelSpec(source="smollm2-135m-instruct", fp8="experts"))
    assert b'"fp8":"experts"' in encode_message(fp8)
    again = RunSpec.model_validate_json(encode_message(fp8))
    assert again.model.fp8 == "experts" and again.spec_hash() == fp8.spec_hash() != named.spec_hash()
    assert _spec(model=ModelSpec(fp8="all")).spec_hash() != _spec().spec_hash()  # tiny-moe + fp8 is not the default
    base = {"run_id": "r", "task": "reverse", "trainer": PEER, "validators": [PEER]}
    (tmp_path / "f.toml").write_text(to_toml({**base, "model": {"fp8": "all"}}))
    assert RunConfig.load(tmp_path / "f.toml").run_spec(PEER).model.fp8 == "all"
    (tmp_path / "g.toml").write_text(to_toml({**base, "model": {"fp8": "int4"}}))
    with pytest.raises(InvalidRunConfig, match="fp8"):
        RunConfig.load(tmp_path / "g.toml")


def test_run_toml_takes_a_model_name_or_table(tmp_path):
    base = {"run_id": "r", "task": "reverse", "trainer": PEER, "validators": [PEER]}
    (tmp_path / "a.toml").write_text(to_toml({**base, "model": "smollm2-135m-instruct"}))
    assert RunConfig.load(tmp_path / "a.toml").run_spec(PEER).model.source == "smollm2-135m-instruct"
    table = {"source": "/models/x", "dtype": "bfloat16", "weights_hash": "blake3:" + "ab" * 32, "max_seq_len": 256}
    (tmp_path / "b.toml").write_text(to_toml({**base, "model": table}))
    assert RunConfig.load(tmp_path / "b.toml").run_spec(PEER).model == ModelSpec(**table)
    (tmp_path / "c.toml").write_text(to_toml({**base, "model": {"source": "x", "quantize": "int4"}}))
    with pytest.raises(InvalidRunConfig, match="quantize"):
        RunConfig.load(tmp_path / "c.toml")


def test_roles_build_the_specs_model_and_check_its_hash():
    spec = _spec()
    model = fresh_model(spec)
    assert model.config == model_config(spec) and tokenizer(spec).vocab_size == model.config.vocab_size
    pinned = _spec(model=ModelSpec(weights_hash=weights_hash(model)))
    assert weights_hash(fresh_model(pinned)) == weights_hash(model)  # every member draws the same version 0
    with pytest.raises(WeightsHashMismatch):
        fresh_model(_spec(model=ModelSpec(weights_hash="blake3:" + "0" * 64)))
    with pytest.raises(UnknownModelName, match="no-such-model"):
        fresh_model(_spec(model=ModelSpec(source="no-such-model")))
    with pytest.raises(ValueError, match="cpu, cuda"):
        check_device("tpu")


def test_a_fetched_version_loads_into_a_blank_model_and_version0_is_checked():
    from node.model.checkpoint import load_hf_state_dict, state_dict_to_hf
    from node.roles.common import blank_model, check_version0

    spec = _spec()
    v0 = fresh_model(spec)
    blank = blank_model(spec)
    load_hf_state_dict(blank, state_dict_to_hf(v0))
    assert weights_hash(blank) == weights_hash(v0)
    check_version0(_spec(model=ModelSpec(weights_hash=weights_hash(v0))), state_dict_to_hf(blank))
    with pytest.raises(WeightsHashMismatch, match="version 0"):
        check_version0(_spec(model=ModelSpec(weights_hash="blake3:" + "1" * 64)), state_dict_to_hf(blank))
    # a version 0 in its served form (an FP8 run's) carries e4m3 bytes, not the values the pin covers: a member
    # without the checkpoint cannot check it and relies on the trainer's signature (it says so), while one in the
    # plain form is still checked, as above
    from node.fp8.quantize import quantize_weight
    from node.model.quantization import SCALE_SUFFIX
    from node.model.served_form import ServedForm

    plain = state_dict_to_hf(blank)
    name = next(n for n in plain if n.endswith("down_proj.weight"))
    q, scales = quantize_weight(plain[name])
    served = ServedForm({**plain, name: q, f"{name}{SCALE_SUFFIX}": scales}, torch.float32)
    check_version0(_spec(model=ModelSpec(weights_hash="blake3:" + "1" * 64)), served)


def test_a_real_checkpoint_defaults_to_bfloat16_and_the_tiny_model_to_float32():
    assert ModelSpec().dtype == "float32"
    assert ModelSpec(source="/models/qwen3-30b-a3b").dtype == "bfloat16"
    assert ModelSpec.model_validate({"source": "smollm2-135m-instruct"}).dtype == "bfloat16"
    assert ModelSpec(source="/models/qwen3-30b-a3b", dtype="float32").dtype == "float32"
    assert ModelSpec.model_validate(ModelSpec(source="x").model_dump()) == ModelSpec(source="x")
