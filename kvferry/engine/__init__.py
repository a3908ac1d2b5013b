"""Engine: sequences, sampling and the generation loop."""
