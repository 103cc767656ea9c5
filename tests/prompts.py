"""Prompts shared by tests of speculative decoding: a code edit whose answer copies most of
its prompt (guesses from the prompt are mostly right)."""

FUNCTION = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result
'''
EDIT = ("Rename the function to rolling_mean and change nothing else. Reply with the code "
        "only.\n\n" + FUNCTION)
