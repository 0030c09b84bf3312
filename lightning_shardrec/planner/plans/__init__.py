"""What a plan is: its vocabulary (``types``, ``table_params``), the tables planned (``tables``), the plan itself
(``sharding_plan``) and the check of a user-given one (``validate``).
May import machine/ and costs/ (a plan's estimates) and configs, errors; never search/.
"""
