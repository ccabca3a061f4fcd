"""What a rank measures: the live-tensor peak on CPU ranks (``cpu_memory``), device memory as the device sees it
(``device_memory``), which device it ran on (``device_identity``) and whether training drew random numbers
(``rng_draws``)."""
