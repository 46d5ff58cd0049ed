"""The silo agent: local data, the model zoo, and the task handlers it runs for a coordinator."""
