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


def _continued(path, prompt, new=NEW):
    """(the tokenizer, the prompt's ids and their continuation) from `fourfold.train.generate`."""
    opened = open_model(path)
    ids = opened.tokenizer.encode(prompt).ids
    try:
        return opened, ids, continue_ids(opened.model, ids, opened.window, new, stop_ids=opened.stop_ids)
    finally:
        dist.destroy_process_group()


def test_greedy_generation_equals_transformers(directory, capsys):
    path, hf = directory
    opened, prompt, ours = _continued(path, PROMPT)
    tokenizer = opened.tokenizer
    # the tokenizer names no end token; config.json's eos_token_id (transformers' default) stops both
    assert opened.stop_ids == {hf.generation_config.eos_token_id}
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0].tolist()
    assert ours == theirs
    assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer.decode(theirs)


def test_generation_stops_at_the_end_of_document_token_as_transformers_does(directory, tmp_path, capsys):
    """A token the model emits midway, named as the tokenizer's eos_token: the sample ends with it,
    as transformers' generate with that eos_token_id."""
    source, hf = directory
    path = tmp_path / "model"
    shutil.copytree(source, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))  # (none: the tokenizer's alone)
    _, prompt, free = _continued(path, PROMPT)
    end = free[len(prompt) + NEW // 2]
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": f"w{end}"}))
    opened, _, ours = _continued(path, PROMPT)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=end)[0].tolist()
    assert opened.stop_ids == {end} and ours == theirs == free[: free.index(end, len(prompt)) + 1]
    assert len(ours) <= len(prompt) + NEW // 2 + 1
    assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out.strip() == opened.tokenizer.decode(theirs)


def test_a_chat_models_turns_end_where_its_generation_config_says(directory, tmp_path, capsys):
    """An instruct model's generation_config.json lists its end-of-turn ids beside the end of text
    (Llama 3's [128001, 128008, 128009]): a sample ends at any of them, as transformers' generate; a
    stop string ends it too, kept in the output; --special-tokens shows the markers the text hides."""
    source, hf = directory
    path = tmp_path / "model"
    shutil.copytree(source, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    _, prompt, free = _continued(path, PROMPT)
    turn_end = free[len(prompt) + NEW // 2]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [VOCAB - 1, turn_end]}))
    opened, _, ours = _continued(path, PROMPT)
    hf.generation_config.eos_token_id = [VOCAB - 1, turn_end]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0].tolist()
    assert opened.stop_ids == {VOCAB - 1, turn_end} and ours == theirs and ours[-1] == turn_end
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))  # the stop string alone
    stop = f"w{free[len(prompt) + 2]}"  # the third new token's text (or an earlier one's, the same)
    assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--stop", stop]) == 0
    shown = capsys.readouterr().out.strip()
    new = [f"w{t}" for t in free[len(prompt):]]
    assert shown.endswith(stop) and shown.split()[len(PROMPT.split()):] == new[: new.index(stop) + 1]


def test_chat_renders_the_models_template_and_prints_its_reply(directory, tmp_path, capsys):
    """--chat: the prompt as a user's turn under the model's own chat template (as transformers'
    apply_chat_template renders it, the generation prompt added); the reply is the new tokens only,
    its turn's markers shown with --special-tokens."""
    source, hf = directory
    path = tmp_path / "model"
    shutil.copytree(source, path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["w1", "w2"]})  # the turns' markers
    # (a training template's {% generation %} marks around the assistant's turns: rendered as their text)
    tokenizer.chat_template = ("{% for m in messages %}w1 {{ m['role'] }} {% if m['role'] == 'assistant' %}"
                               "{% generation %}{{ m['content'] }} w2{% endgeneration %}{% else %}{{ m['content'] }} w2"
                               "{% endif %} {% endfor %}{% if add_generation_prompt %}w1 assistant {% endif %}")
    tokenizer.save_pretrained(path)
    conversation = [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    hf.generation_config.eos_token_id = None
    # (the rendered roles are [UNK], id 0: an attention mask of ones, or transformers would take them for padding)
    theirs = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0].tolist()
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": None}))
    reply = tokenizer.decode(theirs[len(ids):], skip_special_tokens=True)
    assert main(["generate", str(path), "--chat", "--system", "w9 w8", "--prompt", PROMPT, "--max-new-tokens",
                 str(NEW)]) == 0
    assert capsys.readouterr().out.strip() == reply.strip()
    conversation += [{"role": "assistant", "content": "w7 w6"}, {"role": "user", "content": "w4"}]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    theirs = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0].tolist()
    messages = tmp_path / "conversation.json"
    messages.write_text(json.dumps({"messages": conversation}))
    assert main(["generate", str(path), "--messages", str(messages), "--special-tokens", "--max-new-tokens",
                 str(NEW)]) == 0
    assert capsys.readouterr().out.strip() == tokenizer.decode(theirs[len(ids):], skip_special_tokens=False).strip()
    # flags that only a conversation reads are refused without one, and a conversation takes no --prompt
    assert main(["generate", str(path), "--system", "w9"]) == 2
    assert "--system renders a conversation: add --chat" in capsys.readouterr().err
    assert main(["generate", str(path), "--messages", str(messages), "--prompt", "w3"]) == 2
    assert "--messages is the whole conversation" in capsys.readouterr().err


def test_a_directory_without_its_tokenizer_names_the_fix(directory, tmp_path, capsys):
    path, hf = directory
    hf.save_pretrained(tmp_path)  # config.json and safetensors only
    assert main(["generate", str(tmp_path)]) == 2
    assert f"{tmp_path} has no tokenizer.json; put the model's tokenizer.json there" in capsys.readouterr().err
