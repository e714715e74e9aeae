"""Recovery through Airflow's retries: what each failure class may cost, and how the next try adapts.

    policy     the retry decision per failure class (`decide`) and Airflow's `retry_policy` built on it
    adapt      what the next try changes: a smaller micro-batch, the on-demand pool, hosts to avoid
    history    the attempt history: a record per try, written by the try (or by the next one)

Two layers recover a training run: torchrun restarts a crashed rank's whole group inside one try
(`recovery.max_restarts`: seconds, no new Airflow try); anything that needs a new try (out of memory,
a preemption, a hang, a lost node) goes back to Airflow, whose `retry_policy` asks `decide`.
"""
