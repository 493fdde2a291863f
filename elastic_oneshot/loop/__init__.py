"""The layer loop: a layer's inputs, calibration, data, the job."""
