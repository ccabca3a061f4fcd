"""What a trial measured and what a person does with it: results and outcomes, the Pareto front, plots, export,
progress lines (pure except the plot and export writers)."""
