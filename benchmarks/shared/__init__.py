"""What every benchmark shares: the models it trains, its data, result files, figures, where a row ran."""
