"""The decider: accepts tasks, asks the model for undecided steps, journals decisions."""
