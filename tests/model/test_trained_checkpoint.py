"""A trained checkpoint is a complete HF directory: the trainer role's (through `sim`) and
`train-local`'s open in transformers with their tokenizer and chat template, and give our logits."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from node.model import load_checkpoint, save_checkpoint
from node.model.checkpoint import InvalidCheckpoint
from node.model.spec import ModelSpec, load_model
from node.model.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")
MESSAGES = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "stone river"}]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def smol_dir():
    pretrained = pytest.importorskip("node.model.pretrained")
    try:
        return pretrained.smollm2_dir()
    except pretrained.PretrainedUnavailable as exc:
        pytest.skip(str(exc))


def tiny_llama_with_smollm2_tokenizer(directory, smol_dir):
    """A 2-layer llama made by transformers with SmolLM2's vocabulary, tokenizer and chat template."""
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                                   eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copyfile(smol_dir / name, directory / name)
    return directory


def assert_opens_in_transformers_as_ours(ckpt, source) -> None:
    for name in TOKENIZER_FILES:
        assert (ckpt / name).read_bytes() == (source / name).read_bytes(), name
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == HFTokenizer(source).encode_prompt(MESSAGES)
    assert tok.eos_token_id == HFTokenizer(source).eos_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    again = load_model(ModelSpec(source=str(ckpt), dtype="float32"))  # a trained checkpoint is a model source of its own
    assert again.tokenizer.encode_prompt(MESSAGES) == list(ids)
    ours = again.model
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max().item() <= 1e-4
    # the source's config.json comes back (the run capped max_position_embeddings; the file is not capped)
    saved, original = json.loads((ckpt / "config.json").read_text()), json.loads((source / "config.json").read_text())
    assert {k: v for k, v in saved.items() if "dtype" not in k} == {k: v for k, v in original.items() if "dtype" not in k}


def trained(ckpt, source) -> bool:
    before = load_checkpoint(source).state_dict()
    return any(not torch.equal(t, before[n]) for n, t in load_checkpoint(ckpt).state_dict().items())


@pytest.mark.slow
def test_the_trainer_roles_checkpoint_opens_in_transformers_with_its_tokenizer(tmp_path, smol_dir):
    from node.sim import pretrained_run, run_sim

    source = tiny_llama_with_smollm2_tokenizer(tmp_path / "src", smol_dir)
    s = run_sim(tmp_path / "run", inference_nodes=1, steps=2, task="reverse-text", batch_groups=2, group_size=2,
                **pretrained_run(str(source)))
    assert s["status"] == "done" and s["steps"] == 2, s
    ckpt = tmp_path / "run" / "trainer" / "checkpoint"
    assert "step 2: checkpoint written in" in (tmp_path / "run" / "trainer" / "log.txt").read_text()  # the last step's
    assert json.loads((ckpt / "trainer.json").read_text())["step"] == 2  # the last step is saved
    assert trained(ckpt, source)
    assert_opens_in_transformers_as_ours(ckpt, source)


@pytest.mark.slow
def test_a_trained_smollm2_from_train_local_opens_in_transformers(tmp_path, smol_dir):
    from node.train_local import LocalRunConfig, run
    from node.rl.trainer import TrainerConfig

    cfg = LocalRunConfig(task="reverse-text", model="smollm2-135m-instruct", steps=1, prompts=1, samples=2,
                         max_seq_len=64, warmup_target=0.0,
                         trainer=TrainerConfig(lr=3e-5, updates_per_batch=1, minibatches=1))
    ckpt = tmp_path / "checkpoint"
    try:
        run(cfg, tmp_path, progress=False)
        assert load_file(str(ckpt / "model.safetensors"), device="cpu")  # one file, HF names
        assert trained(ckpt, smol_dir)
        assert_opens_in_transformers_as_ours(ckpt, smol_dir)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)  # 1.6 GB with AdamW's state: pytest keeps its tmp dirs


def test_companions_of_another_model_are_refused(tmp_path, smol_dir):
    source = tiny_llama_with_smollm2_tokenizer(tmp_path / "src", smol_dir)
    model = load_checkpoint(source)
    with pytest.raises(InvalidCheckpoint, match="another model"):
        save_checkpoint(model, tmp_path / "out", companions_from=smol_dir)
    save_checkpoint(model, tmp_path / "ok", companions_from=source)  # its own source is accepted
    assert (tmp_path / "ok" / "chat_template.jinja").exists()


def test_a_resumed_trainer_carries_the_runs_config_and_refuses_another_model(tmp_path):
    from node.model.config import ModelConfig
    from node.rl.trainer import Trainer

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, head_dim=16, max_position_embeddings=4096)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    source = load_checkpoint(tmp_path / "src")
    run = source.config.model_copy(update={"max_position_embeddings": 128})  # the run's cap (ModelSpec.max_seq_len)
    source.config = run
    Trainer(source).save(tmp_path / "ckpt", companions_from=tmp_path / "src")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["max_position_embeddings"] == 4096
    assert Trainer.load(tmp_path / "ckpt", run_model=run).model.config == run
    other: ModelConfig = run.model_copy(update={"num_hidden_layers": 2})
    with pytest.raises(InvalidCheckpoint, match="another model.*num_hidden_layers"):
        Trainer.load(tmp_path / "ckpt", run_model=other)
