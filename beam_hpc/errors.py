"""The one exception type the CLI turns into a single line and exit status 1.

Modules raise their own subclasses (SubmitError, ImageError, PrepareError, ...) with a message
written for people; anything else is a bug and keeps its traceback. Invalid input is
``beam_hpc.recipe.RecipeError`` instead (exit status 2).
"""


class ToolError(RuntimeError):
    """An expected failure of a tool or of Slurm, with a message that says what to do."""
