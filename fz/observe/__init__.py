"""What users read off a state: memory and communication reports, full parameters, the monitor."""
