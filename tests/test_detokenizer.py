"""The streaming detokenizer: concatenated deltas equal decoding the whole output at once,
for byte tokens that split multi-byte characters, invalid bytes and specials that render as ''."""

import random

from engine.checkpoint.tokenizer import ByteTokenizer, Detokenizer


def test_deltas_concatenate_to_the_full_decode():
    tok = ByteTokenizer()
    for trial in range(200):
        rng = random.Random(trial)
        text = "".join(rng.choice(["a", "é", "漢", "🙂", " ", "\n"]) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text) + [rng.choice([256, 257, 300]) for _ in range(rng.randint(0, 3))]
        if trial % 4 == 0:
            rng.shuffle(ids)  # invalid UTF-8 in the middle, and at the end
        d = Detokenizer(tok)
        out = "".join(d.push(i) for i in ids) + d.flush()
        assert out == tok.decode(ids), trial


def test_incomplete_character_is_held_back_until_complete():
    d = Detokenizer(ByteTokenizer())
    first, second = "é".encode()
    assert d.push(first) == ""  # half a character: nothing yet
    assert d.push(second) == "é"
    assert d.push(257) == ""  # eos renders as nothing
    assert d.flush() == ""


def test_window_stays_short():
    d = Detokenizer(ByteTokenizer())
    for _ in range(1000):
        d.push(ord("x"))
    assert d.read - d.prefix <= 1  # per-token work does not grow with the output
