"""Rewards for the tiny example: small enough that a random model can learn them in a minute."""


def first_char_correct(completions, answer, **kwargs):
    """1.0 when the completion starts with the answer."""
    return [
        float((c if isinstance(c, str) else c[0]["content"])[:1] == str(a))
        for c, a in zip(completions, answer)
    ]
