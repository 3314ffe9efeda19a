"""`fourfold generate DIR` on a Hugging Face directory (config.json, safetensors, tokenizer.json, as
save_pretrained writes them): greedy decoding equals transformers' `generate`, token for token."""

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from tokenizers import Tokenizer, models, pre_tokenizers

from fourfold.cli.main import main
from fourfold.train.generate import continue_ids, open_model

transformers = pytest.importorskip("transformers")

VOCAB = 61  # odd, as GPT-2's
CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64),
}
PROMPT, NEW = "w5 w17 w3 w42", 16


@pytest.fixture(scope="module", params=list(CONFIGS))
def directory(request, tmp_path_factory):
    """A random model and a word-level tokenizer of its vocabulary, saved as save_pretrained does."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIGS[request.param])
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # weights well apart from their init, so the greedy choices are clear
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(path)
    return path, model


def test_greedy_generation_equals_transformers(directory, capsys):
    path, hf = directory
    model, tokenizer, window, eos = open_model(path)
    prompt = tokenizer.encode(PROMPT).ids
    try:
        ours = continue_ids(model, prompt, window, NEW, eos=eos)
    finally:
        dist.destroy_process_group()
    assert eos is None  # the tokenizer names no end token: all NEW are generated
    hf.generation_config.eos_token_id = None  # (a random model may emit its config's end token)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0].tolist()
    assert ours == theirs and len(ours) == len(prompt) + NEW
    assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer.decode(theirs)


def test_generation_stops_at_the_end_of_document_token_as_transformers_does(directory, tmp_path, capsys):
    """A token the model emits midway, named as the tokenizer's eos_token: the sample ends with it,
    as transformers' generate with that eos_token_id."""
    source, hf = directory
    path = tmp_path / "model"
    shutil.copytree(source, path)
    model, tokenizer, window, _ = open_model(path)
    prompt = tokenizer.encode(PROMPT).ids
    try:
        free = continue_ids(model, prompt, window, NEW)
    finally:
        dist.destroy_process_group()
    end = free[len(prompt) + NEW // 2]
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": tokenizer.id_to_token(end)}))
    model, tokenizer, window, eos = open_model(path)
    try:
        ours = continue_ids(model, prompt, window, NEW, eos=eos)
    finally:
        dist.destroy_process_group()
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=end)[0].tolist()
    assert eos == end and ours == theirs == free[: free.index(end, len(prompt)) + 1]
    assert len(ours) <= len(prompt) + NEW // 2 + 1
    assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer.decode(theirs)


def test_a_directory_without_its_tokenizer_names_the_fix(directory, tmp_path, capsys):
    path, hf = directory
    hf.save_pretrained(tmp_path)  # config.json and safetensors only
    assert main(["generate", str(tmp_path)]) == 2
    assert f"{tmp_path} has no tokenizer.json; put the model's tokenizer.json there" in capsys.readouterr().err
