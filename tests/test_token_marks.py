"""Which tokens overlap marked characters (train/token_marks.py)."""

from lopd_cli.train.token_marks import token_pieces, tokens_overlapping


def test_a_token_is_marked_when_any_of_its_characters_is():
    pieces = ["Ord", "er", " 3", "", "1", "."]          # text "Order 31."
    hit = [c in "31" for c in "Order 31."]             # mark the digits only
    assert tokens_overlapping(pieces, hit) == [False, False, True, False, True, False]


def test_marks_follow_the_character_offsets_of_earlier_pieces():
    pieces = ["ab", "cd", "ef"]
    hit = [False, True, True, False, False, False]     # "bc" straddles the first two pieces
    assert tokens_overlapping(pieces, hit) == [True, True, False]
    assert tokens_overlapping(pieces, [False] * 6) == [False, False, False]


def test_pieces_are_the_tokens_decoded_one_by_one():
    from lopd_cli.models.backbone import load_tokenizer, resolve_backbone

    tokenizer = load_tokenizer(resolve_backbone("tiny"))
    ids = tokenizer("I am eva55@mail.com.")["input_ids"]
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == "I am eva55@mail.com."
