"""What runs amount to: measures, typed results, summaries, verdicts and the text people read."""
