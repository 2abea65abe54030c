"""The one error of training: a setting or input that stops a run, said in one line with its fix."""


class TrainingError(ValueError):
    """Training cannot start as asked (the message says what to change)."""
