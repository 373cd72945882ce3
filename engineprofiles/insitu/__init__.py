"""Engine in the loop: run the real engine on a tiny local model, capture what it materializes,
and compare the trainer against it (in-situ profile fit, end-to-end log-prob mismatch)."""
