"""Prompt text rules, prompt sets and I2V manifests, as read from the user's files.

Owns: parsing and validating those files (one-line errors naming the file). It holds no run
state: the prompt stream's position is the driver's (cluster.driver.state).
"""
