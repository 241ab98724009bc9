"""Isolation, beyond test_service.py: every rpc refuses a missing or wrong token and changes nothing; the
export/import/verify/flush-by-tenant paths leak nothing across tenants; salted users of one tenant never
share a block; isolation holds across a restart."""

from __future__ import annotations

from benchmarks.scenarios import isolation


def test_every_rpc_refuses_a_missing_or_wrong_token_and_changes_nothing(base):
    isolation.check_every_rpc_refuses_a_missing_or_wrong_token_and_changes_nothing(base)


def test_tenants_see_nothing_of_each_other_on_the_newer_paths_and_after_a_restart(base):
    isolation.check_tenants_see_nothing_of_each_other_on_the_newer_paths_and_after_a_restart(base)


def test_salted_users_of_one_tenant_never_share_a_block(base):
    isolation.check_salted_users_of_one_tenant_never_share_a_block(base)


def test_unauthenticated_and_cross_tenant_calls_give_no_error_detail_about_others(base):
    isolation.check_unauthenticated_and_cross_tenant_calls_give_no_error_detail_about_others(base)
