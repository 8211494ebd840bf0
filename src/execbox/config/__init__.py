"""Configuration: the runner's settings (CODE_EXEC_* variables, one field each) and how they are read."""
