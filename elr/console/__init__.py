"""What the user sees on the console besides the step lines: a one-line progress counter for long
work, and the filter that drops known-harmless third-party log lines. Imports nothing of the project."""
