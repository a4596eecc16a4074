"""Results: evaluating a checkpoint, exporting the student, and reporting runs."""
