"""Click commands by area; each module exports COMMANDS. Heavy imports stay inside commands."""
