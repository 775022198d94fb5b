import json
from types import SimpleNamespace

import pytest

from deepserve.model.tokenizer import BOS_TOKEN, EOS_TOKEN, IncrementalDetokenizer, Tokenizer, make_byte_tokenizer

TEXT = "héllo wörld, 世界 says 🎉🎉! naïve café — ok\n"
TRAIN_TEXT = TEXT * 20 + "hello hello world the the"


@pytest.fixture
def byte_dir(tmp_path):
    make_byte_tokenizer(tmp_path, special_tokens=["<｜User｜>"])
    return tmp_path


@pytest.fixture
def bpe_dir(tmp_path):
    make_byte_tokenizer(tmp_path, train_text=TRAIN_TEXT, num_merges=40)
    return tmp_path


def test_byte_tokenizer_layout(byte_dir):
    tok = Tokenizer(byte_dir)
    assert tok.token_to_id(BOS_TOKEN) == 0 and tok.token_to_id(EOS_TOKEN) == 1
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 1, (1,))
    assert tok.vocab_size == 3 + 256
    assert tok.special_token_ids == {0, 1, 2}
    assert tok.encode("AB") == [3 + 65, 3 + 66]  # bytes in byte order after the specials
    assert tok.encode(f"{BOS_TOKEN}hi<｜User｜>") == [0, 3 + 104, 3 + 105, 2]
    assert tok.id_to_token(0) == BOS_TOKEN


def test_merges_are_learned_and_round_trip(bpe_dir, tmp_path):
    tok = Tokenizer(bpe_dir)
    assert 2 + 256 < tok.vocab_size <= 2 + 256 + 40
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode())
    assert tok.decode(ids) == TEXT
    again = make_byte_tokenizer(tmp_path / "again.json", train_text=TRAIN_TEXT, num_merges=40)
    assert again.read_text() == (bpe_dir / "tokenizer.json").read_text()  # deterministic


def test_decode_skips_special_tokens_on_request(byte_dir):
    tok = Tokenizer(byte_dir)
    ids = [0] + tok.encode("hi") + [1]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == f"{BOS_TOKEN}hi{EOS_TOKEN}"


def test_bos_handling(byte_dir):
    tok = Tokenizer(byte_dir)
    assert tok.encode("a") == [3 + 97]  # no post-processor, no tokenizer_config: nothing added
    assert tok.encode("a", add_bos=True) == [0, 3 + 97]
    assert tok.encode(f"{BOS_TOKEN}a", add_bos=True) == [0, 3 + 97]  # never doubled
    config = {"add_bos_token": True, "bos_token": {"content": BOS_TOKEN}}
    (byte_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(byte_dir)
    assert tok.encode("a") == [0, 3 + 97]
    assert tok.encode("a", add_bos=False) == [3 + 97]


def test_ids_from_model_config_win(byte_dir):
    tok = Tokenizer(byte_dir, config=SimpleNamespace(bos_token_id=2, eos_token_ids=[1, 2]))
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (2, 1, (1, 2))


def test_missing_or_corrupt_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer(tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=str(bad)):
        Tokenizer(tmp_path)
    make_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[oops")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("which", ["byte_dir", "bpe_dir"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenization_matches_full_decode(request, which, step):
    tok = Tokenizer(request.getfixturevalue(which))
    prompt = tok.encode("prompt: 日本")
    ids = tok.encode(TEXT) + [1]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids) == TEXT
    assert detok.output_token_ids == ids
    if which == "byte_dir" and step == 1:  # one byte per token: each multi-byte character arrives whole, once
        assert {"é", "世", "界", "🎉", "—"} <= set(deltas)


def test_incremental_keeps_special_tokens_when_asked(byte_dir):
    tok = Tokenizer(byte_dir)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = "".join(detok.add(t) for t in tok.encode("é!") + [1]) + detok.flush()
    assert text == f"é!{EOS_TOKEN}"


def test_incomplete_bytes_are_flushed_at_the_end(byte_dir):
    tok = Tokenizer(byte_dir)
    detok = IncrementalDetokenizer(tok)
    first_byte_of_e_acute = 3 + 0xC3
    assert detok.add(tok.encode("a")) == "a"
    assert detok.add(first_byte_of_e_acute) == ""  # held back: could be the start of "é"
    assert detok.flush() == "\ufffd"
