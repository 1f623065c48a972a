"""The trainer's side: capture each step's change and publish it in the background."""
