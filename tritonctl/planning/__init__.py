"""Planning: the plan file, the planner and its policies, the simulator, the policy comparison."""
