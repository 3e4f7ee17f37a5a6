"""Selection and step costs: selection and its controllers, grouping, exchange, overlap, waiting, exit."""
