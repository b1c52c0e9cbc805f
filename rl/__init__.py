"""Reinforcement learning for the InSS scheduler: the SAC-Discrete agent (`rl.sac`), later its environment."""
