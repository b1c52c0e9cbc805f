"""The measurement harness behind `tritonctl profile`: solo and co-located runs through Triton."""
