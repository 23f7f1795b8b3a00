"""What the user sees on the console besides the step lines: a one-line progress counter for long
work, the filter that drops known-harmless third-party log lines, and Ctrl-C / SIGTERM as one line
(interrupt.py). Imports nothing of the project."""
