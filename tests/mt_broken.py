"""A calculator that always raises (tests/test_multi_turn_train.py): every call the model makes fails."""


def calc(expression: str) -> str:
    """A broken calculator.

    Args:
        expression: ignored
    """
    raise ArithmeticError("the calculator is broken")
