"""Images in prompts: what a model's items look like (`spec`), the items a request carries (`inputs`), turning images and text into them
(`processor`, the API side), and the vision encoder with its cache (`encoder`, the runner side)."""
