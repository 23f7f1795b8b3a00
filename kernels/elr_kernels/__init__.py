"""This project's GPU kernels, under an import name of its own (`elr_kernels`), so that the top-level
`kernels/` folder never shadows Hugging Face's `kernels` package, which transformers imports.
The folder `kernels/` itself is not a package. Imports only torch and triton."""
